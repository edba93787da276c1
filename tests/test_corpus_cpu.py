"""The GPU corpus (scripts/corpus/) on a CPU: every program runs as written, its graphs built
the frontend's way through plancache, so that an API slip or a graph plancache cannot key
or rebuild shows here before the GPU run (scripts/gpu_corpus.py).

CUDA is stood in for: tensors made "on cuda" are made on the CPU, handles and kernel caches
are placeholders, the frontend's GPU-only steps are tests/frontend_cpu.py's stand-ins and
the plans are the CPU test backend's. Its reference kernels cover convolutions, matmuls,
pointwise ops and attention (paged decode included), so the numbers of those programs are
checked too; norms, attention backward and the variants it cannot evaluate must still be
keyed and rebuilt (their notice says so), and their numbers are left to the GPU. Every
graph reaches the cache (dynamic shapes with the frontend's kernel cache too), and no
stored plan needs more workspace than its program allows.
"""

from __future__ import annotations

import json
import runpy
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cudnn
import pytest
from frontend_cpu import CpuFrontend, cpu_frontend

import plancache
import plancache.integrations.frontend as frontend
from plancache import PlanCache, PlanCacheNotice
from plancache.testing import CpuTestBackend

torch = pytest.importorskip("torch")
from torch.overrides import TorchFunctionMode  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "scripts" / "corpus"
PROGRAMS = sorted(p.stem for p in CORPUS.glob("[a-z]*.py"))

#: The notice a program may give here: the CPU backend lacks the kernel (a GPU has it).
CPU_ONLY = "the CPU test backend cannot run"
#: The CPU backend's attention knows no paging: it takes the caches for K and V and refuses.
CPU_REFUSES = {"sdpa_paged_with_graph": "the graph is invalid"}
#: Programs whose numbers the CPU backend computes (the others' kernels or masks it lacks).
CHECKED_NUMBERS = {"conv_bias_relu_five_step", "matmul_bias_gelu_build", "matmul_scale_bias_relu_with_graph",
                   "matmul_graph_cache_jit", "sdpa_unsupported_rejected", "conv_dynamic_kernel_cache",
                   "conv_matmul_workspace_limit", "sdpa_decode_paged_serving"}  # fmt: skip


class _CudaOnCpu(TorchFunctionMode):
    """Tensors asked for on "cuda" are made (or left) on the CPU."""

    def __torch_function__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        name = getattr(func, "__name__", "")
        if name == "cuda" or (name == "to" and len(args) > 1 and str(args[1]).startswith("cuda")):
            return args[0]
        return func(*args, **kwargs)


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[CpuFrontend]:
    for name, value in (("synchronize", lambda *a: None), ("get_device_name", lambda *a: "cpu"),
                        ("current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)
    for name, value in (("create_handle", lambda: None), ("set_stream", lambda **k: None),
                        ("create_kernel_cache", object), ("backend_version_string", lambda: "cpu")):  # fmt: skip
        monkeypatch.setattr(cudnn, name, value)
    tensor_like = cudnn.pygraph.tensor_like

    def device_tensor_like(graph: Any, template: Any, *args: Any, **kwargs: Any) -> Any:
        made = tensor_like(graph, template, *args, **kwargs)
        made.is_pass_by_value = False  # a CPU tensor would be a host scalar; these stand for device tensors
        return made

    monkeypatch.setattr(cudnn.pygraph, "tensor_like", device_tensor_like)
    monkeypatch.syspath_prepend(str(CORPUS))
    with cpu_frontend() as stand_ins:
        yield stand_ins


def run_program(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], list[str], PlanCache]:
    cache = PlanCache(tmp_path / name, backend=CpuTestBackend())
    frontend.use(cache)
    plancache.install()
    try:
        with warnings.catch_warnings(record=True) as caught, _CudaOnCpu():
            warnings.simplefilter("always")
            runpy.run_path(str(CORPUS / f"{name}.py"), run_name="__main__")
    finally:
        plancache.uninstall()
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("CORPUS_RESULT ")][-1]
    notices = [str(w.message) for w in caught if issubclass(w.category, PlanCacheNotice)]
    return json.loads(line.removeprefix("CORPUS_RESULT ")), notices, cache


@pytest.mark.slow
@pytest.mark.parametrize("name", PROGRAMS)
def test_each_corpus_program_runs_through_plancache(on_cpu: CpuFrontend, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    name: str) -> None:  # fmt: skip
    result, notices, cache = run_program(name, tmp_path, capsys)
    assert result["outcome"] == "ok", result["notes"]
    assert result["pipeline_patched"] and result["graphs"]
    for notice in notices:  # nothing unkeyable or not rebuildable: every graph reached the cache
        allowed = [text for text in (CPU_ONLY, CPU_REFUSES.get(name)) if text]
        assert any(text in notice for text in allowed), notice
    assert cache.counters["misses"] == len(result["graphs"]), cache.counters
    stored = cache.store.keys()
    if name in CHECKED_NUMBERS:
        assert result["ok"], result["outputs"]
        assert cache.counters["builds"] == len(result["graphs"]) == len(stored)
    for key in stored:  # every plan within its program's limit
        entry = cache.store.get(key)
        limit = entry.options["workspace_limit"]
        assert limit is None or entry.workspace_size <= limit, (entry.workspace_size, limit)
    cache.close()


def test_the_corpus_covers_every_idiom() -> None:
    sources = {name: (CORPUS / f"{name}.py").read_text() for name in PROGRAMS}
    for idiom in (".build_plans()", ".build([", "with cudnn.graph(", "@cudnn.jit", "@cudnn.graph_cache", "kernel_cache=",
                  "is_dynamic_shape_enabled=True", "ragged_offset", "paged_attention_k_table", "sdpa_backward", ".layernorm(",
                  ".rmsnorm(", ".instancenorm(", ".batchnorm(", "deselect_workspace_greater_than(", "tensor_uids=",
                  "threading.Thread"):  # fmt: skip
        assert any(idiom in text for text in sources.values()), idiom
    for text in [*sources.values(), (CORPUS / "_corpus.py").read_text()]:  # frontend code: no plancache in it
        assert "import plancache" not in text and "from plancache" not in text
