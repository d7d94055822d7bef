"""One rule for bad input (kivi_xpu.validation, docs/errors.md): integers of any integer type but not bool/float,
names checked against the allowed values, empty environment variables are unset, bad values are errors naming the
argument or variable in every backend mode."""

import numpy as np
import pytest
import torch
from conftest import require_backend
from tiny_models import tiny_llama_config

from kivi_xpu import KiviCache, KiviSettings, qat
from kivi_xpu.backend import select
from kivi_xpu.validation import ENVIRONMENT


@pytest.mark.parametrize("integer", [np.int64, np.int32, np.uint8, torch.tensor, int])
def test_integer_options_take_every_integer_type_and_store_ints(integer):
    settings = KiviSettings(
        bits=integer(2),
        group_size=integer(16),
        residual_length=integer(32),
        key_bits=integer(4),
        value_group_size=integer(8),
        sink_tokens=integer(2),
    )
    for field in ("bits", "group_size", "residual_length", "key_bits", "value_bits", "key_group_size", "sink_tokens"):
        assert type(getattr(settings, field)) is int, field
    assert settings == KiviSettings(2, 16, 32, key_bits=4, value_group_size=8, sink_tokens=2)
    assert settings.replace(bits=integer(4)).value_bits == 4  # value_bits still follows bits
    cache = KiviCache(config=tiny_llama_config(), bits=integer(4), group_size=integer(16), backend="reference")
    assert cache.settings.bits == 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bits": True}, "`bits` must be an integer, got the bool True"),
        ({"bits": 2.0}, "`bits` must be an integer, got float 2.0"),
        ({"group_size": 32.0}, "`group_size` must be an integer"),
        ({"residual_length": "128"}, "`residual_length` must be an integer, got str '128'"),
        ({"sink_tokens": 1.5}, "`sink_tokens` must be an integer"),
        ({"key_bits": np.float64(4)}, "`key_bits` must be an integer"),
        ({"value_group_size": torch.tensor(8.0)}, "`value_group_size` must be an integer"),
        ({"meta_dtype": "float16"}, "`meta_dtype` must be a torch.dtype.*got the string 'float16'"),
        ({"meta_dtype": 16}, "`meta_dtype` must be a torch.dtype"),
        ({"attention": 0}, "`attention` must be a string, one of"),
        ({"backend": 1}, "`backend` must be a string, one of"),
        ({"device": 0}, "`device` must be a SYCL filter string"),
    ],
)
def test_a_value_of_the_wrong_type_is_a_type_error_naming_the_argument(kwargs, match):
    with pytest.raises(TypeError, match=match):
        KiviCache(config=tiny_llama_config(), **({"backend": "reference"} | kwargs))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bits": np.int64(3)}, r"`bits` must be one of \(2, 4, 8\), got 3"),
        ({"group_size": np.int64(0)}, "`group_size` must be a positive integer, got 0"),
        ({"sink_tokens": -1}, "`sink_tokens` must be a non-negative integer, got -1"),
        ({"attention": "fused"}, r"`attention` must be one of \('auto', 'dense'\), got 'fused'"),
        ({"backend": ""}, "`backend` must be one of"),
    ],
)
def test_a_value_out_of_range_is_a_value_error_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KiviCache(config=tiny_llama_config(), **({"backend": "reference"} | kwargs))


@pytest.mark.parametrize("backend", ["reference", "auto", "native", "sycl"])
@pytest.mark.parametrize("device", ["", ":::", "opencl::0", "opencl:cpu:0:1", "opencl cpu"])
def test_a_malformed_device_is_an_error_in_every_mode(backend, device):
    with pytest.raises(ValueError, match=r"`device` must be a SYCL filter string.*got " + repr(device)):
        select(backend, device)


def test_the_qat_integers_follow_the_rule():
    settings = KiviSettings(group_size=16, residual_length=32)
    key_mask, _ = qat.decode_read_masks(settings, np.int64(40), prefill_length=np.int32(8))
    assert key_mask.shape == (40, 40)
    with pytest.raises(TypeError, match="`length` must be an integer"):
        qat.decode_read_masks(settings, 40.0)
    with pytest.raises(ValueError, match="`prefill_length` must be a non-negative integer"):
        qat.decode_read_masks(settings, 40, prefill_length=-1)


# --- environment variables: empty = unset, for every variable; a bad value names the variable ------------------


@pytest.fixture
def clean_environment(monkeypatch):
    for variable in ENVIRONMENT:
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


@pytest.mark.parametrize("variable", list(ENVIRONMENT))
def test_an_empty_variable_means_unset(clean_environment, variable):
    unset = select()
    clean_environment.setenv(variable, "")
    assert select() == unset


@pytest.mark.parametrize("backend", ["reference", "auto", "native", "sycl", None])
def test_a_malformed_device_variable_is_an_error_naming_it_in_every_mode(clean_environment, backend):
    clean_environment.setenv("KIVI_XPU_DEVICE", ":::")
    with pytest.raises(ValueError, match=r"`\$KIVI_XPU_DEVICE` must be a SYCL filter string.*':::'"):
        select(backend)


def test_a_bad_backend_variable_names_it(clean_environment):
    clean_environment.setenv("KIVI_XPU_BACKEND", "gpu")
    with pytest.raises(ValueError, match=r"`\$KIVI_XPU_BACKEND` must be one of \('auto', 'native', 'sycl'"):
        select()


@pytest.mark.parametrize("backend", ["reference", "auto", "native", "sycl"])
@pytest.mark.parametrize("what", ["a directory", "missing"])
def test_a_bad_kernel_source_path_is_an_error_naming_it_in_every_mode(clean_environment, tmp_path, backend, what):
    path = tmp_path if what == "a directory" else tmp_path / "missing.cpp"
    clean_environment.setenv("KIVI_XPU_KERNEL_SOURCE", str(path))
    with pytest.raises(ValueError, match=rf"\$KIVI_XPU_KERNEL_SOURCE=.* must name a readable file, but it is {what}"):
        select(backend)


def test_a_cpu_isa_variable_this_cpu_lacks_names_it(clean_environment):
    require_backend("native")
    clean_environment.setenv("KIVI_XPU_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match=r"`\$KIVI_XPU_CPU_ISA` must be one of the instruction sets of this CPU"):
        select("native")
