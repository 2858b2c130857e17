import warnings

import pytest
import torch

from model.config import preset
from model.model import GLMModel


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    return GLMModel(preset("tiny")).eval()


@pytest.fixture(scope="module")
def quiet_transformers():
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
