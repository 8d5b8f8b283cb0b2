# Stage 5: frozen analysis notebooks (committed without outputs). Snakemake's notebook directive executes
# them into <outdir>/logs/notebooks/ (its preamble embeds this machine's paths); rule publish_notebook
# writes the copies kept in <outdir>/notebooks/ without them.

NB_CLAIMS = {"claims": f"{OUT}/claims.csv", "reproduction": f"{OUT}/reproduction.csv", "claim_json": CLAIM_JSON}
NB_CERTIFICATES = {"steps": [f"{d}/steps.parquet" for study in sorted({STUDIES[n]["source"] for n in COMPUTED})
                              for d in cell_dirs(study)]}
NOTEBOOK_OUTPUTS = {
    "claims": [f"{OUT}/notebooks/claims_summary.md"],
    "certificates": [f"{OUT}/notebooks/certificates_by_layer.csv"],
}
NOTEBOOKS = [f"{OUT}/notebooks/{name}.ipynb" for name in NOTEBOOK_OUTPUTS] + [
    path for paths in NOTEBOOK_OUTPUTS.values() for path in paths
]


rule notebook_claims:
    input:
        **NB_CLAIMS,
    output:
        NOTEBOOK_OUTPUTS["claims"],
    log:
        notebook=f"{OUT}/logs/notebooks/claims.ipynb",
    notebook:
        "../notebooks/claims.py.ipynb"


rule notebook_certificates:
    input:
        **NB_CERTIFICATES,
    output:
        NOTEBOOK_OUTPUTS["certificates"],
    log:
        notebook=f"{OUT}/logs/notebooks/certificates.ipynb",
    notebook:
        "../notebooks/certificates.py.ipynb"


rule publish_notebook:
    input:
        # the executed notebook is the notebook rule's log (a log cannot be an input): depend on its output
        executed=lambda wc: NOTEBOOK_OUTPUTS[wc.name],
    output:
        f"{OUT}/notebooks/{{name}}.ipynb",
    wildcard_constraints:
        name="|".join(NOTEBOOK_OUTPUTS),
    params:
        notebook=lambda wc: f"{OUT}/logs/notebooks/{wc.name}.ipynb",
        rule=lambda wc: f"notebook_{wc.name}",
        inputs=lambda wc: {"claims": NB_CLAIMS, "certificates": NB_CERTIFICATES}[wc.name],
        outputs=lambda wc: NOTEBOOK_OUTPUTS[wc.name],
    script:
        "../scripts/publish_notebook.py"
