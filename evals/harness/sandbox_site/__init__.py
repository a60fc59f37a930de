"""Files bound read-only into every sandbox (``evals.harness.sandbox_bwrap``); never imported by the
harness itself (importing ``sitecustomize`` here would install the audit hook in the harness)."""
