"""GPU test of the frontend drop-in on this pass's corpus programs (scripts/corpus/): dynamic
shapes with the frontend's kernel cache over eight shapes, instance and batch norms, a
program with a workspace limit, and paged decode written as serving libraries write it. Each
runs unchanged with ``PLANCACHE_PATCH_CUDNN=1`` in a cold process and then a warm one on
the same cache, and:

* its outputs match a float32 PyTorch reference in both;
* the cold run stores a plan per graph, or says why it did not (a plan that cannot be loaded
  back is never stored: ``stats()["unstored_plans"]``);
* the warm run serves every stored plan from the store, loaded by its lookup (a hit) or,
  with auto-prime on as it is by default, by the primer ahead of it (then a memory hit),
  and deserializes each once into the program's graph (``pygraph.deserialize`` counted:
  before, a drop-in hit deserialized twice; the primer loads through cuDNN's C API, so
  only a plan it had to load the frontend's way, ``native_fallbacks``, adds one);
* every stored plan keeps its program's workspace limit, and dynamic-shape graphs are
  stored per shape with the kernel cache flag in their key.

Marked ``gpu``; skipped without CUDA; run by scripts/gpu-check. About 2 minutes on an H200.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]

from plancache.store import Store  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "scripts" / "corpus"
PROGRAMS = ["batchnorm_training_build", "conv_dynamic_kernel_cache", "conv_matmul_workspace_limit", "instancenorm_five_step",
            "sdpa_decode_paged_serving"]  # fmt: skip

#: Runs a corpus program in this process, patched by the variable, counting every
#: deserialization, then prints the drop-in cache's figures.
CHILD = r"""
import json, runpy, sys
import cudnn
import plancache  # PLANCACHE_PATCH_CUDNN=1: the patch is in force from here
deserialized = []
original = cudnn.pygraph.deserialize
def counting(self, *args, **kwargs):
    deserialized.append(1)
    return original(self, *args, **kwargs)
cudnn.pygraph.deserialize = counting
runpy.run_path(sys.argv[1], run_name="__main__")
import plancache.integrations.frontend as frontend
stats = frontend.current().stats()
print("CHILD_STATS " + json.dumps({"counters": stats["process"], "unloadable": stats["unstored_plans"],
                                   "deserialized": len(deserialized)}))
"""


def _run(program: str, cache_dir: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")}
    env.update(PLANCACHE_DIR=str(cache_dir), PLANCACHE_PATCH_CUDNN="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(CORPUS), os.environ.get("PYTHONPATH")])))  # fmt: skip
    done = subprocess.run([sys.executable, "-c", CHILD, str(CORPUS / f"{program}.py")], env=env, capture_output=True, text=True,
                          timeout=300, cwd=str(CORPUS))  # fmt: skip
    assert done.returncode == 0, f"{program}: {done.stdout[-2000:]}{done.stderr[-4000:]}"
    lines = done.stdout.splitlines()
    result = json.loads(next(line for line in lines if line.startswith("CORPUS_RESULT ")).removeprefix("CORPUS_RESULT "))
    stats = json.loads(next(line for line in lines if line.startswith("CHILD_STATS ")).removeprefix("CHILD_STATS "))
    return {**stats, "result": result, "stderr": done.stderr}


@pytest.mark.parametrize("program", PROGRAMS)
def test_this_passes_programs_are_served_stored_and_hit_once_each(tmp_path: Path, program: str) -> None:
    cache_dir = tmp_path / "plancache"
    cold = _run(program, cache_dir)
    warm = _run(program, cache_dir)
    for phase, run in (("cold", cold), ("warm", warm)):
        assert run["result"]["outcome"] == "ok" and run["result"]["ok"], (phase, run["result"], run["stderr"][-3000:])
    graphs = len(cold["result"]["graphs"])
    store = Store(cache_dir)
    keys = store.keys()
    refused = cold["unloadable"]
    print(f"\n{program}: {graphs} graphs, {len(keys)} stored, refused {json.dumps(refused)}; "
          f"deserialized cold {cold['deserialized']}, warm {warm['deserialized']}")  # fmt: skip
    assert cold["counters"]["misses"] == graphs and len(keys) + len(refused) == graphs, (cold["counters"], refused)
    assert all(r["reason"] for r in refused.values())
    # Auto-prime (the default) may load a plan before the program asks for it: "primed", not a hit.
    served = warm["counters"]["hits"] + warm["counters"]["primed"]
    assert served == len(keys) and warm["counters"]["misses"] == len(refused), warm["counters"]
    assert len(store.keys()) == len(keys), "the warm run stores nothing new"
    if not refused:  # a hit deserializes once, into the program's graph; a miss once, to load it back
        warm_expected = graphs + warm["counters"]["native_fallbacks"]  # a primer's load the frontend's way
        assert cold["deserialized"] == graphs and warm["deserialized"] == warm_expected, (
            cold["deserialized"], warm["deserialized"], warm["counters"])  # fmt: skip
    for key in keys:
        entry = store.get(key)
        limit = entry.options["workspace_limit"]
        assert limit is None or entry.workspace_size <= limit, (key, entry.workspace_size, limit)
        over = [c for c in entry.candidates if "over the limit" in (c.get("error") or "")]
        if over:
            print(f"  {key[:12]}: {len(over)} candidates refused for workspace, e.g. {over[0]['error']}")
        if program == "conv_matmul_workspace_limit":
            assert limit == 1 << 20
        if program == "conv_dynamic_kernel_cache":
            assert entry.description["flags"]["dynamic_shape"] and entry.description["flags"]["kernel_cache"]
    store.close()
