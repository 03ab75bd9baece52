"""``use_vllm`` in the main environment (no vLLM installed): the settings are checked and a missing engine or an
impossible mode fails at construction with what to do; the vLLM runs themselves are in ``tests/test_vllm.py``."""

from __future__ import annotations

import importlib.util

import pytest
from helpers import make_trainer

from trl_ppomax import PPOMaxConfig


def test_presets_set_the_importance_sampling_correction(tmp_path):
    assert PPOMaxConfig(output_dir=str(tmp_path)).vllm_importance_sampling_correction is True
    assert PPOMaxConfig(output_dir=str(tmp_path), preset="vanilla").vllm_importance_sampling_correction is False
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_max must be a finite number ≥ 1"):
        PPOMaxConfig(output_dir=str(tmp_path), vllm_importance_sampling_clip_max=0.5)
    with pytest.raises(ValueError, match="vllm_mode must be one of"):
        PPOMaxConfig(output_dir=str(tmp_path), vllm_mode="remote")


def test_server_mode_without_cuda_says_why(tmp_path):
    with pytest.raises(ValueError, match=r"needs CUDA.*vllm_mode='colocate'"):
        make_trainer(tmp_path, use_vllm=True, vllm_mode="server")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_missing_vllm_says_how_to_install(tmp_path):
    with pytest.raises(ImportError, match="use_vllm=True needs vLLM"):
        make_trainer(tmp_path, use_vllm=True)
