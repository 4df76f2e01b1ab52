"""`fleetserve chat` and `fleetserve complete`: talk to a running server from a terminal, as
`vllm chat` / `vllm complete` do.

    fleetserve chat                                   # interactive, against 127.0.0.1:8000
    fleetserve chat -q "What is the capital of France?" --temperature 0
    echo "The capital of France is" | fleetserve complete --max-tokens 8
    fleetserve chat --url http://10.0.0.5:8000/v1 --api-key $KEY --system-prompt "Be brief."

Replies stream as they are generated; a reasoning model's thinking (a server started with
--reasoning-parser) streams to stderr, dimmed on a terminal, so stdout holds only the
answers. `--extra-body` adds any other request field. `chat` keeps the conversation (each turn resends it,
as OpenAI's API wants); `complete` sends every line as a prompt of its own. Ctrl-C while a
reply streams cancels that reply (the server aborts the request when the connection
closes) and returns to the prompt; Ctrl-C or Ctrl-D at the prompt ends the session.

Only the standard library: it starts in a fraction of a second and needs neither torch nor
ray, so it also runs on a laptop against a remote cluster. Every network wait is bounded
(`--timeout`: connecting, and each wait for the next piece of a reply).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
import urllib.error
import urllib.request
from typing import Any, Iterator, Optional

DEFAULT_URL = "http://127.0.0.1:8000/v1"


class ClientError(Exception):
    """A failure to show the user in one line; `fatal` ends even an interactive session."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help="the server's OpenAI base URL [default: %(default)s]")
    p.add_argument(
        "--model-name", default=None, help="the model to ask [default: the first one the server's /v1/models lists]"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="the server's API key [default: $FLEETSERVE_API_KEY, else $OPENAI_API_KEY, else none]",
    )
    p.add_argument(
        "-q",
        "--quick",
        metavar="MESSAGE",
        default=None,
        help="send MESSAGE, print the reply and exit [default: interactive; lines from "
        "stdin when it is not a terminal]",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="most tokens per reply [default: the server's (chat: to the context's end)]",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature [default: the model's own, as the server applies it]",
    )
    p.add_argument(
        "--extra-body",
        metavar="JSON",
        default=None,
        help="a JSON object merged into every request body, for fields the flags do not "
        'name (e.g. \'{"chat_template_kwargs": {"enable_thinking": false}}\') '
        "[default: none]",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds to wait to connect, and for each next piece of a reply [default: %(default)s]",
    )


def add_chat_parser(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a running server (streams replies; like `vllm chat`)",
        description="Chat with a running fleetserve (or any OpenAI-compatible) server from the terminal.",
    )
    _add_common(p)
    p.add_argument("--system-prompt", default=None, help="a system message first [default: none]")
    p.set_defaults(func=cmd_chat)


def add_complete_parser(sub) -> None:
    p = sub.add_parser(
        "complete",
        help="complete prompts on a running server (like `vllm complete`)",
        description="Send prompts to a running server's /v1/completions and print the completions as they stream.",
    )
    _add_common(p)
    p.set_defaults(func=cmd_complete)


class Client:
    def __init__(self, args: argparse.Namespace, command: str) -> None:
        self.url = args.url.rstrip("/")
        self.command = command
        self.timeout = args.timeout
        self.api_key = args.api_key or os.environ.get("FLEETSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
        self.model = args.model_name or self._first_model()

    def _request(self, method: str, path: str, body: Optional[dict] = None):
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise ClientError(self._http_error(e), fatal=e.code in (401, 403)) from None
        except urllib.error.URLError as e:
            reason = getattr(e.reason, "strerror", None) or str(e.reason)
            raise ClientError(
                f"cannot reach {self.url} ({reason}): is `fleetserve serve` running there? (--url to point elsewhere)",
                fatal=True,
            ) from None
        except (socket.timeout, TimeoutError):
            raise ClientError(
                f"{self.url}{path} did not answer within {self.timeout:g} s (--timeout)", fatal=True
            ) from None
        except (http.client.HTTPException, OSError) as e:  # e.g. the server closed the connection
            raise ClientError(f"{self.url}{path} failed: {e or type(e).__name__}", fatal=True) from None

    def _http_error(self, e: urllib.error.HTTPError) -> str:
        try:
            body = e.read().decode("utf-8", "replace")
        except OSError:
            body = ""
        message = body.strip()[:500] or e.reason
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        hint = " (the server wants an API key: --api-key or $FLEETSERVE_API_KEY)" if e.code == 401 else ""
        return f"HTTP {e.code}: {message}{hint}"

    def _first_model(self) -> str:
        with self._request("GET", "/models") as r:
            try:
                models = [m["id"] for m in json.load(r)["data"]]
            except (ValueError, KeyError, TypeError):
                raise ClientError(
                    f"{self.url}/models did not list models as OpenAI's API does (--model-name to name one)", fatal=True
                ) from None
        if not models:
            raise ClientError(f"{self.url}/models lists no model", fatal=True)
        return models[0]

    def stream(self, path: str, body: dict) -> Iterator[tuple[bool, str]]:
        """POST with `stream: true`; yields `(is_reasoning, text)` for each delta as it
        arrives: a reasoning model's thinking (`reasoning_content`, or `reasoning`, with the
        server's --reasoning-parser) apart from its answer."""
        body = {**body, "model": self.model, "stream": True}
        with self._request("POST", path, body) as r:
            while True:
                try:
                    raw = r.readline()
                except (socket.timeout, TimeoutError):
                    raise ClientError(f"no reply for {self.timeout:g} s (--timeout); gave up") from None
                except (http.client.HTTPException, OSError) as e:
                    raise ClientError(f"the connection broke mid-reply: {e or type(e).__name__}") from None
                if not raw:
                    raise ClientError("the server closed the stream before it ended")
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                try:
                    event = json.loads(payload)
                except ValueError:
                    raise ClientError(f"unreadable event in the stream: {payload[:200]!r}") from None
                if "error" in event:
                    err = event["error"]
                    raise ClientError(
                        "the server ended the reply with an error: "
                        + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
                    )
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    thought = delta.get("reasoning_content") or delta.get("reasoning")
                    if thought:
                        yield True, thought
                    text = choice.get("text")
                    if text is None:
                        text = delta.get("content")
                    if text:
                        yield False, text


def _inputs(quick: Optional[str], banner: str) -> Iterator[str]:
    if quick is not None:
        yield quick
        return
    interactive = sys.stdin.isatty()
    if interactive:
        print(banner, file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return
        if line.strip():
            yield line


def _extra_body(args: argparse.Namespace, command: str) -> Optional[dict[str, Any]]:
    """`--extra-body` as a dict ({} when not given), once --url and --timeout are checked;
    None (the problem printed) when any of the three is wrong."""
    for bad, message in (
        (
            not args.url.startswith(("http://", "https://")),
            f"--url must start with http:// or https://, got {args.url!r}",
        ),
        (not args.timeout > 0, f"--timeout must be positive, got {args.timeout:g}"),
    ):
        if bad:
            print(f"fleetserve {command}: {message}", file=sys.stderr)
            return None
    if args.extra_body is None:
        return {}
    try:
        extra = json.loads(args.extra_body)
    except ValueError:
        extra = None
    if not isinstance(extra, dict):
        print(f"fleetserve {command}: --extra-body must be a JSON object, got {args.extra_body!r}", file=sys.stderr)
        return None
    return extra


def _run(args: argparse.Namespace, command: str, path: str, make_body, remember=None) -> int:
    out = sys.stdout
    extra = _extra_body(args, command)
    if extra is None:
        return 2
    try:
        client = Client(args, command)
    except ClientError as e:
        print(f"fleetserve {command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    sampling = {
        **extra,
        **{k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature)) if v is not None},
    }
    # Thinking goes to stderr (dimmed on a terminal): stdout holds the answers alone.
    dim, plain = ("\033[2m", "\033[0m") if sys.stderr.isatty() else ("", "")
    failed = False
    try:
        banner = f"model {client.model} at {client.url}; Ctrl-C cancels a reply, Ctrl-D ends"
        for text in _inputs(args.quick, banner):
            reply: list[str] = []
            thinking = False
            try:
                for is_thought, piece in client.stream(path, {**make_body(text), **sampling}):
                    if is_thought:
                        sys.stderr.write(("" if thinking else dim) + piece)
                        sys.stderr.flush()
                        thinking = True
                        continue
                    if thinking:
                        sys.stderr.write(plain + "\n")
                        thinking = False
                    reply.append(piece)
                    out.write(piece)
                    out.flush()
                if thinking:
                    sys.stderr.write(plain + "\n")
                out.write("\n")
                out.flush()
                if remember is not None:
                    remember(text, "".join(reply))
            except ClientError as e:
                if thinking:
                    sys.stderr.write(plain + "\n")
                if reply:
                    out.write("\n")
                print(f"fleetserve {command}: {e}", file=sys.stderr)
                failed = True
                if e.fatal or args.quick is not None:
                    return 1
            except KeyboardInterrupt:  # cancel this reply; the closed connection aborts it
                if thinking:
                    sys.stderr.write(plain)
                out.write("\n")
                print("[cancelled]", file=sys.stderr)
                if args.quick is not None:
                    return 130
    except KeyboardInterrupt:  # at the prompt
        print(file=sys.stderr)
    return 1 if failed else 0


def cmd_chat(args: argparse.Namespace) -> int:
    messages: list[dict] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})

    def body(text: str) -> dict:
        return {"messages": messages + [{"role": "user", "content": text}]}

    def remember(text: str, reply: str) -> None:  # only turns that were answered in full
        messages.extend([{"role": "user", "content": text}, {"role": "assistant", "content": reply}])

    return _run(args, "chat", "/chat/completions", body, remember)


def cmd_complete(args: argparse.Namespace) -> int:
    return _run(args, "complete", "/completions", lambda text: {"prompt": text})
