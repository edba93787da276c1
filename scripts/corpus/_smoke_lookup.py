"""A smoke run's one program (scripts/gpu_corpus.py --smoke), run as the corpus programs are:
it imports cuDNN Frontend (which the start-up hook patches under ``PLANCACHE_PATCH_CUDNN=1``),
looks one tiny graph up through the installed plancache on its CPU test backend when
patched (the cold run stores the plan, the warm run hits it), and prints the report line
the corpus programs print. Not a cuDNN program: its name starts with ``_``, so the GPU
run's listing leaves it out.
"""

from __future__ import annotations

import json
import os
import sys
import time

import cudnn  # the program's own import: the start-up hook patches cuDNN Frontend here

PREFIX = "CORPUS_RESULT "

started = time.perf_counter()
graphs = {}
if os.environ.get("PLANCACHE_PATCH_CUDNN") == "1":
    from plancache import PlanCache
    from plancache.testing import CpuTestBackend
    from plancache.workflows import templates

    cache = PlanCache(backend=CpuTestBackend(), auto_prime=False)  # PLANCACHE_DIR: the runner's, per program
    cache.get(templates.build("matmul_bias_act", b=1, m=4, k=8, n=4))
    cache.close()  # writes the warm run's hit
graphs["matmul_bias_act"] = {"first_call_ms": (time.perf_counter() - started) * 1e3}
print(PREFIX + json.dumps({
    "program": "_smoke_lookup", "idiom": "smoke: one PlanCache.get", "outcome": "ok", "ok": True, "graphs": graphs,
    "first_call_ms_total": sum(g["first_call_ms"] for g in graphs.values()), "outputs": {}, "notes": [],
    "plancache_loaded": "plancache" in sys.modules, "pipeline_patched": hasattr(cudnn.pygraph.build_plans, "__plancache_original__"),
}))  # fmt: skip
