"""`pagedserve client generate|chat|info`: talk to a running pagedserve server over gRPC.

    pagedserve client generate "The capital of France is" --max-tokens 8
    pagedserve client generate "Once upon a time" --stream --temperature 0.8 --seed 1
    pagedserve client chat "What is the capital of France?" --system "Be brief." --stream
    pagedserve client chat                   # interactive: one user turn per stdin line, until EOF
    pagedserve client info --target 10.0.0.5:9000

Only argparse is imported at module level: the offline `pagedserve generate` builds this parser too and
should not pay for (or need) grpc.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add the `client` command to the `pagedserve` console script's subparsers."""
    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument("--target", default="127.0.0.1:9000", help="server address host:port (default %(default)s)")
    conn.add_argument("--application", default="pagedserve",
                      help="Ray Serve application name to route to (default %(default)s)")
    conn.add_argument("--timeout", type=float, default=120.0,
                      help="deadline per request in seconds, 0 for none (default %(default)s)")
    conn.add_argument("--api-key", default=None,
                      help="the server's API key (default: the PAGEDSERVE_API_KEY environment variable)")

    # Defaults of None leave the field unset, so the server's defaults apply.
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--stream", action="store_true", help="print the text as it is generated")
    sampling.add_argument("--max-tokens", type=int, default=None)
    sampling.add_argument("--temperature", type=float, default=None, help="0: greedy")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None, help="-1: off")
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("--stop", nargs="+", action="extend", default=None, metavar="STR",
                          help="stop string(s), not included in the output; give it after the prompt")
    sampling.add_argument("--adapter", default=None, help="a LoRA adapter the server serves, by name")

    client = subparsers.add_parser("client", help="talk to a running pagedserve server over gRPC",
                                   description="Talk to a running pagedserve server (Ray Serve gRPC proxy).")
    commands = client.add_subparsers(dest="client_command", required=True)
    gen = commands.add_parser("generate", parents=[conn, sampling], help="complete a prompt")
    gen.add_argument("prompt")
    chat = commands.add_parser("chat", parents=[conn, sampling],
                               help="chat: one turn with MESSAGE, else one turn per stdin line until EOF")
    chat.add_argument("message", nargs="?", default=None,
                      help="the user message; without it, read user turns from stdin, keeping the history")
    chat.add_argument("--system", default=None, help="system message")
    commands.add_parser("info", parents=[conn], help="print the served model's info as JSON")


def run(args: argparse.Namespace) -> int:
    """Run a parsed `pagedserve client ...` command; returns the exit status."""
    from pagedserve.client.errors import PagedServeError
    from pagedserve.client.sdk import Client

    try:
        with Client(args.target, args.application, timeout=args.timeout or None, api_key=args.api_key) as client:
            if args.client_command == "info":
                print(json.dumps(client.model_info(), indent=2))
            elif args.client_command == "generate":
                _generate(client, args)
            elif args.message is not None:
                _chat_turn(client, _system(args) + [{"role": "user", "content": args.message}], args)
            else:
                _chat_loop(client, args)
    except PagedServeError as e:
        print(f"error: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as e:  # rejected before anything was sent, like a usage error
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the stream's cleanup has cancelled the request on the server
        print(file=sys.stderr)
        return 130
    return 0


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed, "stop": args.stop, "adapter": args.adapter}


def _system(args: argparse.Namespace) -> list[dict[str, str]]:
    return [{"role": "system", "content": args.system}] if args.system else []


def _print_stream(stream: Any) -> str:
    """Print a stream's text to stdout (its reasoning, where the server parses it out, to stderr); the text."""
    parts = []
    thought = False
    with stream:
        for chunk in stream:
            if chunk.reasoning:
                thought = True
                sys.stderr.write(chunk.reasoning)
                sys.stderr.flush()
            parts.append(chunk.text)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    if thought:
        sys.stderr.write("\n")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts)


def _generate(client: Any, args: argparse.Namespace) -> None:
    if args.stream:
        _print_stream(client.stream(args.prompt, **_sampling(args)))
    else:
        print(client.generate(args.prompt, **_sampling(args)).text)


def _chat_turn(client: Any, messages: list[dict[str, str]], args: argparse.Namespace) -> str:
    if args.stream:
        return _print_stream(client.stream_chat(messages, **_sampling(args)))
    done = client.chat(messages, **_sampling(args))
    if done.reasoning:  # stdout holds only the answers
        print(done.reasoning, file=sys.stderr, flush=True)
    print(done.text, flush=True)
    return done.text


def _chat_loop(client: Any, args: argparse.Namespace) -> None:
    messages = _system(args)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:  # the prompt goes to stderr so that stdout holds only the replies
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            if interactive:
                print(file=sys.stderr)
            return
        user = line.rstrip("\n")
        if not user.strip():
            continue
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": _chat_turn(client, messages, args)})
