"""A tool-calling agent written against the ``openai`` package only, run against ``glm5 proxy`` (docs/rl-agents.md).

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=none python docs/examples/openai_agent.py [EPISODES]

Each episode reveals 1 to 3 numbers, one per user turn, offers a ``calc`` tool in OpenAI's format, answers the
model's tool calls, then asks for the total; the reward is 1.0 when the answer's first line is the total. The
``X-Trajectory-Id`` header names the episode, so the proxy extends one token record per episode (the ids the engine
sampled are what an RL run would train on). A random-init policy answers noise: expect rewards of 0.0 and few tool
calls until the policy is trained (``glm5 rl --config configs/rl_openai_agent.yaml``).
"""
import json
import random
import sys

import openai

CALC = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate a sum such as 3+4",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calc(arguments: str) -> str:
    try:
        terms = str(json.loads(arguments)["expression"]).split("+")
        return str(sum(int(t) for t in terms))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def episode(client: openai.OpenAI, model: str, name: str, numbers: list) -> tuple:
    """Play one episode; (reward, turns)."""
    headers = {"X-Trajectory-Id": name}
    messages = [{"role": "system", "content": "Add the numbers with calc. Answer with the total only."}]
    turns = 0
    for i, n in enumerate(numbers):
        messages.append({"role": "user", "content": f"{'First' if i == 0 else 'Next'}: {n}"})
        reply = client.chat.completions.create(model=model, messages=messages, tools=[CALC], max_tokens=16,
                                               extra_headers=headers).choices[0].message
        turns += 1
        messages.append(reply.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        for call in reply.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(call.function.arguments)})
    messages.append({"role": "user", "content": "answer:"})
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                            extra_headers=headers).choices[0].message.content or ""
    first_line = answer.strip().splitlines()[0] if answer.strip() else ""
    return (1.0 if first_line == str(sum(numbers)) else 0.0), turns + 1


def main() -> None:
    client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    model = client.models.list().data[0].id
    rng = random.Random(0)
    episodes = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    rewards = []
    for k in range(episodes):
        numbers = [rng.randint(0, 9) for _ in range(rng.randint(1, 3))]
        reward, turns = episode(client, model, f"episode-{k}", numbers)
        rewards.append(reward)
        print(f"episode {k}: numbers {numbers}, {turns} requests, reward {reward}")
    print(f"mean reward {sum(rewards) / len(rewards):.3f} over {len(rewards)} episodes")


if __name__ == "__main__":
    main()
