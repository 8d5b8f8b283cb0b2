# Stage 5: frozen analysis notebooks (committed without outputs); executed copies land in
# <outdir>/notebooks/ through Snakemake's notebook directive.

NOTEBOOKS = [
    f"{OUT}/notebooks/claims.ipynb",
    f"{OUT}/notebooks/claims_summary.md",
    f"{OUT}/notebooks/certificates.ipynb",
    f"{OUT}/notebooks/certificates_by_layer.csv",
]


rule notebook_claims:
    input:
        claims=f"{OUT}/claims.csv",
        reproduction=f"{OUT}/reproduction.csv",
        claim_json=CLAIM_JSON,
    output:
        f"{OUT}/notebooks/claims_summary.md",
    log:
        notebook=f"{OUT}/notebooks/claims.ipynb",
    notebook:
        "../notebooks/claims.py.ipynb"


rule notebook_certificates:
    input:
        steps=CELL_STEPS,
    output:
        f"{OUT}/notebooks/certificates_by_layer.csv",
    log:
        notebook=f"{OUT}/notebooks/certificates.ipynb",
    notebook:
        "../notebooks/certificates.py.ipynb"
