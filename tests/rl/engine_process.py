"""What a spawned test process runs (a module of its own: spawn re-imports it by name in the child)."""
import torch


def serve_engine(conn):
    """Child process: an engine server with its own random weights; dumps them on request."""
    torch.set_num_threads(1)
    from safetensors.torch import save_file

    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.rl.serving.engine import RolloutEngine
    from glm5_core.rl.serving.server import EngineServer

    torch.manual_seed(1)
    model = GLM5ForCausalLM(GLM5Config.tiny(index_topk=8)).eval()
    server = EngineServer(RolloutEngine(model, max_batch=2, max_len=32), weight_version="default").start()
    conn.send(server.url)
    path = conn.recv()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    conn.send("saved")
    conn.recv()
    server.shutdown()
