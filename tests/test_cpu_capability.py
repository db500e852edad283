"""`common.cpu_capability`: which vectorized CPU kernels PyTorch runs (llm/runtime.py).

PyTorch fixes the level at a process's first vectorized operation, so most checks run in a
fresh interpreter."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm import runtime
from llm.config import CommonConfig, ConfigError, load_params_text

ROOT = Path(__file__).resolve().parents[1]
X86 = platform.machine().lower() in runtime.X86_MACHINES
needs_x86 = pytest.mark.skipif(not X86, reason="the kernel levels are x86's")


def python(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")} | env
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)


@needs_x86
def test_stage_setup_sets_the_level_before_any_operation():
    # every stage module imported first, as `python -m stages.<name>` does: none may run an operation
    r = python("import importlib, pkgutil, os, torch, stages\n"
               "for m in pkgutil.iter_modules(stages.__path__): importlib.import_module('stages.' + m.name)\n"
               "from llm.config import CommonConfig\n"
               "from llm.runtime import setup_runtime\n"
               "setup_runtime(CommonConfig(seed=0, device='cpu', dtype='auto', nproc=1, num_threads=1,"
               " cpu_kernels=True, cpu_capability='default'))\n"
               "print(torch.backends.cpu.get_cpu_capability(), os.environ['ATEN_CPU_CAPABILITY'])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["DEFAULT", "default"]


@needs_x86
def test_a_level_fixed_earlier_is_an_error_not_ignored():
    if python("import torch; print(torch.backends.cpu.get_cpu_capability())").stdout.strip() == "DEFAULT":
        pytest.skip("this CPU's own level is DEFAULT: nothing to contradict")
    r = python("import torch; torch.randn(64).exp()\n"
               "from llm.runtime import apply_cpu_capability; apply_cpu_capability('default')")
    assert r.returncode != 0
    assert "common.cpu_capability: default, but PyTorch already runs its" in r.stderr
    assert "ATEN_CPU_CAPABILITY=default" in r.stderr


@needs_x86
def test_the_environment_and_the_param_must_agree():
    r = python("from llm.runtime import apply_cpu_capability; apply_cpu_capability('default')",
               ATEN_CPU_CAPABILITY="avx2")
    assert r.returncode != 0 and "the environment sets ATEN_CPU_CAPABILITY=avx2" in r.stderr
    r = python("from llm.runtime import apply_cpu_capability; print(apply_cpu_capability('default'))",
               ATEN_CPU_CAPABILITY="DEFAULT")
    assert r.returncode == 0 and r.stdout.strip() == "DEFAULT", r.stderr


@needs_x86
def test_avx2_holds_mkls_matrix_products_to_avx2_too():
    # MKL picks its own code path by processor: on an Intel CPU with AVX-512 its products rounded
    # otherwise than on machines without it until it was held to AVX2 (MKL_VERBOSE names the path)
    if "avx2" not in (runtime._cpu_flags() or {"avx2"}):
        pytest.skip("this processor has no AVX2")
    r = python("import os, torch\n"
               "from llm.runtime import apply_cpu_capability; apply_cpu_capability('avx2')\n"
               "a = torch.randn(64, 64); a @ a\n"
               "print('MKL_ENABLE_INSTRUCTIONS', os.environ['MKL_ENABLE_INSTRUCTIONS'])", MKL_VERBOSE="1")
    assert r.returncode == 0, r.stderr
    assert "MKL_ENABLE_INSTRUCTIONS AVX2" in r.stdout
    if torch.backends.mkl.is_available():
        banner = next(line for line in r.stdout.splitlines() if line.startswith("MKL_VERBOSE oneMKL"))
        assert "AVX-512" not in banner, banner
        # MKL names its code path in the banner on Intel processors only; an AMD one's banner
        # names none (seen on an AMD EPYC: "... Intel(R) Architecture processors, Lnx 2.60GHz ...")
        if "(Intel(R) " in banner:
            assert "(Intel(R) AVX2)" in banner, banner


@needs_x86
def test_an_mkl_level_in_the_environment_must_agree():
    r = python("from llm.runtime import apply_cpu_capability; apply_cpu_capability('avx2')",
               MKL_ENABLE_INSTRUCTIONS="SSE4_2")
    assert r.returncode != 0
    assert "common.cpu_capability: avx2, but the environment sets MKL_ENABLE_INSTRUCTIONS=SSE4_2" in r.stderr
    r = python("import os\nfrom llm.runtime import apply_cpu_capability; apply_cpu_capability('avx2')\n"
               "print(os.environ['MKL_ENABLE_INSTRUCTIONS'])", MKL_ENABLE_INSTRUCTIONS="avx2")
    assert r.returncode == 0 and r.stdout.strip() == "AVX2", r.stderr  # the same level, in MKL's spelling


@needs_x86
def test_a_level_the_processor_lacks_names_the_missing_flags(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n")
    monkeypatch.setattr(runtime, "CPUINFO", cpuinfo)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    with pytest.raises(ConfigError, match="common.cpu_capability: avx512, but this processor lacks avx512f,"
                                          " avx512bw, avx512vl, avx512dq"):
        runtime.apply_cpu_capability("avx512")
    cpuinfo.write_text("flags\t\t: fpu sse sse2 avx\n")
    with pytest.raises(ConfigError, match="lacks avx2, fma"):
        runtime.apply_cpu_capability("avx2")
    assert "ATEN_CPU_CAPABILITY" not in os.environ  # refused before anything was set
    assert "MKL_ENABLE_INSTRUCTIONS" not in os.environ


def test_not_x86_says_so_and_changes_nothing(monkeypatch, capsys):
    monkeypatch.setattr(runtime.platform, "machine", lambda: "arm64")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    assert runtime.apply_cpu_capability("avx2") == torch.backends.cpu.get_cpu_capability()
    assert "applies to x86 processors only; this arm64 processor" in capsys.readouterr().out
    assert "ATEN_CPU_CAPABILITY" not in os.environ and "MKL_ENABLE_INSTRUCTIONS" not in os.environ


def test_empty_leaves_pytorchs_choice(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    assert runtime.apply_cpu_capability("") == torch.backends.cpu.get_cpu_capability()
    assert "ATEN_CPU_CAPABILITY" not in os.environ and "MKL_ENABLE_INSTRUCTIONS" not in os.environ
    assert CommonConfig(seed=0, device="cpu", dtype="auto", nproc=1, num_threads=1, cpu_kernels=True).cpu_capability == ""


def test_params_refuse_an_unknown_level():
    text = (ROOT / "params.yaml").read_text().replace("cpu_capability: avx2", "cpu_capability: avx3")
    assert "cpu_capability: avx3" in text
    with pytest.raises(ConfigError, match="cpu_capability"):
        load_params_text(text, "params.yaml")
