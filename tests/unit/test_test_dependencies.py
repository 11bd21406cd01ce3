"""The test extras are installed: several test modules import them with pytest.importorskip, which
would turn a missing dependency into skipped suites; this test turns it into a failure instead."""
import importlib

import pytest


@pytest.mark.parametrize("name", ["transformers", "safetensors", "triton", "tqdm", "depyf", "expecttest", "hypothesis",
                                  "accelerate", "compressed_tensors", "peft"])
def test_test_dependency_is_installed(name):
    importlib.import_module(name)
