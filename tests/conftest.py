import pytest

from tests.checkpoints import make_full_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny full Qwen3-VL checkpoint (text + vision, sharded, custom pixel limits) saved by transformers."""
    return make_full_checkpoint(tmp_path_factory.mktemp("tiny-qwen3vl"))
