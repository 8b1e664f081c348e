"""Our top-level `kernels` package must not be mistaken for Hugging Face's `kernels` library."""

import importlib.util


def test_transformers_does_not_take_our_kernels_for_hf_kernels():
    from transformers.utils import import_utils

    assert importlib.util.find_spec("kernels") is not None  # ours is importable...
    assert import_utils.is_kernels_available() is False  # ...and transformers does not believe it is HF's


def test_kernels_package_exports_no_hf_kernels_names():
    import kernels

    for name in ("get_kernel", "use_kernel_forward_from_hub", "LayerRepository", "kernelize"):
        assert not hasattr(kernels, name)
