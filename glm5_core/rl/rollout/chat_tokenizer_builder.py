"""A chat tokenizer for trying agents without a real model's tokenizer (``glm5 make-tokenizer DIR``): a byte-level
BPE trained here with the ``tokenizers`` package on a few KB of generated text, saved as a Hugging Face tokenizer
directory (``tokenizer.json`` + ``tokenizer_config.json`` with a Jinja ``chat_template``), with one of three chat
templates:

* ``CHATML_TEMPLATE``: ChatML with a role separator token, as Phi-4 writes it
  (``<|im_start|>{role}<|im_sep|>{content}<|im_end|>``): every boundary between pieces appended one message at a
  time is next to a special token, so byte-level BPE can never merge across it. Tool calls are Hermes-style
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; tools are listed in the system turn.
  ``{% generation %}`` marks assistant text, so transformers can return its own assistant-token mask.
* ``NEWLINE_CHATML_TEMPLATE``: the same with classic ChatML role headers (``<|im_start|>assistant\\n``);
* ``GLM_TEMPLATE``: GLM-4 style (``[gMASK]<sop><|user|>\\n...<|assistant|>\\n...<|observation|>\\n...``): there is
  no end-of-turn token; the assistant stops on the next role token (``<|user|>`` / ``<|observation|>``, listed in
  ``generation_config.json``), which is also the first token of the next message.

Nothing is downloaded. Its vocabulary (``vocab_size`` plus the tool tokens) must fit the policy's: the tiny preset's
vocabulary (256 bytes) is too small, so a run with it sets ``model.overrides.vocab_size`` (``glm5 make-tokenizer``
prints the value). A real model's tokenizer directory (its ``tokenizer.json`` + ``tokenizer_config.json`` with a
``chat_template``) works the same way.
"""
from __future__ import annotations

import json
import os
import random

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"]
GLM_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]  # added, not special: decoded text keeps them

CHATML_TEMPLATE = (
    "{%- if tools %}"
    "<|im_start|>system<|im_sep|>"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You can call these tools:"
    "{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}"
    'Call one as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.<|im_end|>'
    "{%- elif messages[0].role == 'system' %}"
    "<|im_start|>system<|im_sep|>{{ messages[0].content }}<|im_end|>"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "<|im_start|>assistant<|im_sep|>"
    "{%- generation %}"
    "{%- if message.content %}{{ message.content }}{% endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>"
    "{%- endfor %}"
    "<|im_end|>"
    "{%- endgeneration %}"
    "{%- else %}"
    "<|im_start|>{{ message.role }}<|im_sep|>{{ message.content }}<|im_end|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant<|im_sep|>{% endif %}"
)

# Classic ChatML (the role header ends in "\n"): the model's first token follows a newline, not a special token,
# so byte-level BPE can merge across that boundary ("\n" + "    x" is "\n   " + " x" as one text). For tests that
# show why CHATML_TEMPLATE is laid out as it is.
NEWLINE_CHATML_TEMPLATE = CHATML_TEMPLATE.replace("<|im_sep|>", "{{ '\\n' }}")

GLM_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if tools %}<|system|>\nTools:"
    "{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|assistant|>{{ '\\n' }}"
    "{%- if message.content %}{{ message.content }}{% endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>"
    "{%- endfor %}"
    "{%- elif message.role == 'tool' %}<|observation|>\n{{ message.content }}"
    "{%- else %}<|{{ message.role }}|>\n{{ message.content }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


def training_text(seed: int = 0, size: int = 6000) -> str:
    """A few KB of chat-like English, arithmetic and tool-call JSON."""
    rng = random.Random(seed)
    words = ("add the numbers with calc first next answer tool result error the sum of is what please call "
             "expression function name arguments value total number you can these one").split()
    lines = []
    while sum(map(len, lines)) < size:
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))).capitalize() + ".")
        elif kind == 1:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            lines.append(f"{a}+{b}={a + b}")
        elif kind == 2:
            expr = f"{rng.randint(0, 9)}+{rng.randint(0, 9)}"
            lines.append(json.dumps({"name": "calc", "arguments": {"expression": expr}}))
        else:
            lines.append(f"next: {rng.randint(0, 9)} answer: {rng.randint(0, 99)}")
    # indented lines: whitespace runs after a newline become merges ("\n " ...), as in real vocabularies
    return "".join(("    " if i % 3 == 2 else "") + line + "\n" for i, line in enumerate(lines))


STYLES = ("chatml", "chatml_newline", "glm")


def build_tokenizer_dir(path: str, *, style: str = "chatml", vocab_size: int = 400,
                        template_in_config: bool = True) -> str:
    """Train a byte-level BPE and save it with the ``style`` chat template ("chatml", "chatml_newline" or "glm")
    under ``path``.
    With ``template_in_config`` false the template goes to ``chat_template.jinja`` (newer transformers layout)."""
    if style not in STYLES:
        raise ValueError(f"style: expected one of {', '.join(STYLES)}, got {style!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 300 <= vocab_size <= 65536:
        raise ValueError(f"vocab_size: expected an int in [300, 65536] (256 bytes + specials + merges), "
                         f"got {vocab_size!r}")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = GLM_SPECIALS if style == "glm" else CHATML_SPECIALS
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = training_text()
    tokenizer.train_from_iterator([text[i:i + 500] for i in range(0, len(text), 500)], trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    os.makedirs(path, exist_ok=True)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    template = {"chatml": CHATML_TEMPLATE, "chatml_newline": NEWLINE_CHATML_TEMPLATE, "glm": GLM_TEMPLATE}[style]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>" if style == "glm"
              else "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 4096}
    if template_in_config:
        config["chat_template"] = template
    else:
        with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(template)
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    if style == "glm":  # GLM lists its turn-ending tokens as extra EOS ids in generation_config.json
        ids = [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
        with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": ids}, f)
    return path


def tokenizer_vocab_size(path: str) -> int:
    """The vocabulary a policy needs for the tokenizer saved under ``path`` (highest id + 1)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    return tokenizer.get_vocab_size(with_added_tokens=True)
