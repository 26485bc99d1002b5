# Stage: report. results/report.md and its PNG plots, rendered by `runmap report` from the bench records
# alone (tables per model, decode tok/s and peak memory against resident experts per layer with the
# baselines on the same axes, one-factor comparisons, campaign conformance findings).

REPORT_MD = f"{RESULTS}/report.md"
REPORT_PLOTS = f"{RESULTS}/report-plots"


rule report:
    output:
        md=REPORT_MD,
        plots=directory(REPORT_PLOTS),
    input:
        records=f"{BENCH_DIR}/records",
        summary=f"{BENCH_DIR}/campaign.json",
        code=code("cli.report", "bench"),
    log:
        f"{LOGS}/report.log",
    shell:
        "runmap report --records {input.records} --out {output.md} --plots-dir {output.plots} > {log} 2>&1"


FINAL_OUTPUTS.extend([REPORT_MD, REPORT_PLOTS])
