"""``runmap serve``: an OpenAI-compatible HTTP server over one engine, with continuous batching,
Prometheus metrics and a local page (chat, what is loaded, live telemetry, IFEval, campaign reports).

Modules: ``batching`` (the step loop over the engine's prefill / decode: rows join and leave a running
batch), ``scheduler`` (the engine thread: admission, cancellation, events back to the HTTP side),
``protocol`` (typed OpenAI request and response models), ``metrics`` (the Prometheus registry),
``ifeval_job`` (the page's IFEval runs, through runmap.ifeval), ``campaigns`` (the page's campaign
reports, through runmap.bench.report) and ``app`` (the FastAPI application). Nothing here is imported by
``runmap --help``: the CLI module imports it inside ``run``.
"""

# How waiting requests join running rows (runmap serve --join-mode; runmap.serve.batching): the first is the default.
# A plain tuple here, so that the CLI's parser can list them without importing torch.
JOIN_MODES = ("whole", "interleaved", "concurrent", "mixed")
