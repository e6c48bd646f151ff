"""Agents the openai_agent tests name by import path (``tests.rl.rollout.envs.agent_fixtures:...``): each takes
``(client, model, task)`` like a user's agent, and fails in one way."""
import time


def one_number_task(rng):
    return {"numbers": [rng.randint(0, 9)]}


def broken_task(rng):
    raise KeyError("no tasks today")


def ask_once(client, model):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "First: 1"}])


def raising_agent(client, model, task):
    """Generates once, then crashes."""
    ask_once(client, model)
    raise RuntimeError("agent bug")


def silent_agent(client, model, task):
    """Never calls the proxy."""
    return 1.0


def hanging_agent(client, model, task):
    """Generates once, then hangs past any timeout_s the tests set; its late request must fail."""
    ask_once(client, model)
    time.sleep(10)
    ask_once(client, model)
    return 1.0


def text_reward_agent(client, model, task):
    """Returns what is not a number."""
    ask_once(client, model)
    return "1.0"


def constant_agent(client, model, task):
    ask_once(client, model)
    return 0.5


def token_sum_reward():
    """A reward factory whose rewards differ between samples of a group (so the policy gets a gradient)."""
    def score(sample) -> float:
        return float(sum(sample["response_ids"]) % 5)
    return score
