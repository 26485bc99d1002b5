"""``runmap serve``: an OpenAI-compatible HTTP server over one engine, with continuous batching,
Prometheus metrics and a local page (chat, what is loaded, live telemetry, IFEval, campaign reports).

Modules: ``batching`` (the step loop over the engine's prefill / decode: rows join and leave a running
batch), ``scheduler`` (the engine thread: admission, cancellation, events back to the HTTP side),
``protocol`` (typed OpenAI request and response models), ``metrics`` (the Prometheus registry),
``ifeval_job`` (the page's IFEval runs, through runmap.ifeval), ``campaigns`` (the page's campaign
reports, through runmap.bench.report) and ``app`` (the FastAPI application). Nothing here is imported by
``runmap --help``: the CLI module imports it inside ``run``.
"""
