"""Every Python snippet of README.md runs as written, in order, in one namespace (as a reader
pastes them into one session): on the CPU test backend here, on a GPU in tests/test_gpu.py.

On the CPU the README's text is changed in two ways only, and nowhere else:

* ``plancache.PlanCache(`` calls a ``PlanCache`` with ``backend=CpuTestBackend()`` (the
  documented way to run the cache without a GPU) given, in the directory the test's
  ``PLANCACHE_DIR`` names;
* ``device="cuda"`` becomes ``device="cpu"``.

A snippet that needs a GPU for what it shows (a CUDA-graph capture, the frontend's own
``g.execute``) is marked with ``<!-- gpu-only -->`` on the line right before its fence: it
is compiled here and run by tests/test_gpu.py. Anything a snippet raises fails the test.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
GPU_ONLY = "<!-- gpu-only -->"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


@dataclass(frozen=True)
class Snippet:
    line: int  # of the first line of code in README.md
    code: str
    gpu_only: bool


def snippets(text: str | None = None) -> list[Snippet]:
    """The README's ```python blocks, each with whether the line before its fence marks it
    gpu-only."""
    text = README.read_text() if text is None else text
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append(Snippet(text.count("\n", 0, match.start(1)) + 1, match.group(1), before.strip() == GPU_ONLY))
    return found


def compile_snippet(snippet: Snippet, device: str, cache_call: str) -> Any:
    code = snippet.code.replace('device="cuda"', f'device="{device}"').replace("plancache.PlanCache(", f"{cache_call}(")
    # Blank lines first, so that a traceback names the snippet's line in README.md.
    return compile("\n" * (snippet.line - 1) + code, str(README), "exec")


def run_readme(
    device: str, make_cache: Callable[..., Any], *, gpu: bool, text: str | None = None
) -> Iterator[tuple[Snippet, dict[str, Any]]]:
    """Run the snippets in order in one namespace (gpu-only ones only with ``gpu``), each
    ``plancache.PlanCache(...)`` through ``make_cache(...)``; yield after each snippet."""
    namespace: dict[str, Any] = {"__name__": "__readme__", "__readme_cache__": make_cache}
    for snippet in snippets(text):
        code = compile_snippet(snippet, device, "__readme_cache__")
        if snippet.gpu_only and not gpu:
            continue
        exec(code, namespace)
        yield snippet, namespace


def cpu_cache() -> Callable[..., Any]:
    import plancache
    from plancache.testing import CpuTestBackend

    return functools.partial(plancache.PlanCache, backend=CpuTestBackend())


def quick_start_matches_pytorch(namespace: dict[str, Any], tolerance: float = 1e-2) -> None:
    x, w, b, y = (namespace[n] for n in ("x", "w", "b", "y"))
    ref = torch.relu(torch.nn.functional.conv2d(x.float(), w.float(), padding=1) + b.float())
    assert float((y.float() - ref).norm() / ref.norm()) < tolerance


def test_every_snippet_runs_on_the_cpu_test_backend() -> None:
    ran = []
    for snippet, namespace in run_readme("cpu", cpu_cache(), gpu=False):
        ran.append(snippet)
        if len(ran) == 1:  # the quick start
            quick_start_matches_pytorch(namespace)
            assert namespace["plan"].source == "built"
    assert len(ran) >= 2, "the README lost the snippets that run without a GPU"
    assert [s.line for s in ran] == [s.line for s in snippets() if not s.gpu_only]


def test_gpu_only_snippets_compile() -> None:
    marked = [s for s in snippets() if s.gpu_only]
    assert marked, "the capture and frontend snippets are gpu-only"
    for snippet in marked:
        compile_snippet(snippet, "cuda", "__readme_cache__")


def test_every_gpu_only_mark_belongs_to_a_snippet() -> None:
    text = README.read_text()
    marks = re.findall(rf"^\s*{re.escape(GPU_ONLY)}\s*$", text, re.M)
    assert len(marks) == sum(s.gpu_only for s in snippets()), f"a {GPU_ONLY} mark is not right before a ```python fence"
    first = snippets()[0]
    assert not first.gpu_only and "plancache.PlanCache(" in first.code, "the quick start must run on the CPU"


def test_a_broken_snippet_fails() -> None:
    """The test is honest: without the output's name, executing by name raises, as it did
    when the quick start's example could not work."""
    from plancache import TensorMismatchError

    broken = README.read_text().replace('.set_name("y")', "", 1)
    with pytest.raises(TensorMismatchError, match="'y' is not a tensor of this plan"):
        for _ in run_readme("cpu", cpu_cache(), gpu=False, text=broken):
            pass


def test_the_readme_names_templates_as_what_build_takes() -> None:
    """A template is a name for ``templates.build(name, ...)``, not an attribute: the README
    once listed `conv_bias_act` as if ``templates.conv_bias_act`` existed."""
    from plancache.workflows import templates

    text = README.read_text()
    for name in templates.TEMPLATES:
        assert f"`{name}`" not in text, f"README names the template {name} as if it were an attribute"
    for attribute in re.findall(r"\btemplates\.(\w+)", text):
        assert hasattr(templates, attribute), f"README names templates.{attribute}, which does not exist"
    assert 'templates.build("conv_bias_act"' in text


def test_the_cpu_install_says_which_torch_build_it_gets() -> None:
    """``torch==2.13.0`` names no build: which one pip installs depends on the index (PyPI's
    Linux wheels are CUDA builds), so the constraints and the README say how to get the CPU
    build instead of claiming that the pin does."""
    constraints = (README.parent / "constraints-cpu.txt").read_text()
    cpu_index = "https://download.pytorch.org/whl/cpu"
    assert "installs the CPU build" not in constraints and "pins the CPU build" not in README.read_text()
    assert cpu_index in constraints and cpu_index in README.read_text()
