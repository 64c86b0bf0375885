"""`kvpool chat`: an interactive conversation, streamed token by token."""

from __future__ import annotations

import sys

from kvpool.commands.generate import add_sampling_args, sampling_from_args
from kvpool.engine.config import add_engine_args, engine_config_from_args


def add_arguments(p) -> None:
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show the engine's INFO log lines (quiet by default: warnings and errors only)")
    p.set_defaults(quiet_by_default=True)
    add_sampling_args(p)
    p.set_defaults(max_tokens=256)
    add_engine_args(p)


def main(args) -> int:
    config = engine_config_from_args(args)  # bad flags fail here, before torch is imported
    params = sampling_from_args(args)
    from kvpool.engine.engine import Engine

    engine = Engine(config)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("kvpool chat — empty line or Ctrl-D to quit; /reset starts over.", file=sys.stderr)
    while True:
        try:
            user = input("you> ").strip()
        except EOFError:
            break
        if not user:
            break
        if user == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": user})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        rid = engine.add_request(engine.tokenizer.encode(prompt, add_special_tokens=False), params)
        pieces = []
        print("assistant> ", end="", flush=True)
        while engine.has_unfinished():
            for out in engine.step():  # each step's new text
                if out.request_id == rid and out.outputs:
                    pieces.append(out.outputs[0].text)
                    print(pieces[-1], end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(pieces)})
    return 0
