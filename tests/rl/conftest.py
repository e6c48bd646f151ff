import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """The CI machine has 2 shared cores: more threads per process only oversubscribe them."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_policy():
    """A random-init tiny GLM-5-style policy with a small DSA top-k, so sequences longer than k exercise
    the sparse selection."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM

    torch.manual_seed(0)
    return GLM5ForCausalLM(GLM5Config.tiny(index_topk=8, max_position_embeddings=128)).eval()
