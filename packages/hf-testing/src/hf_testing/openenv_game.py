"""An OpenEnv environment server for the tests and docs: a digit-guessing game written with
``openenv-core``'s own server classes and app factory, served on loopback.

``python -m hf_testing.openenv_game --port P`` serves the game; ``--unreliable-of URL``
serves instead a relay in front of the game at ``URL`` that fails some episodes the ways a
broken server does: episodes whose reset seed is 0 mod 3 get a non-JSON answer to their first
step, 1 mod 3 get their socket closed mid-episode (the server "dies"), the rest are relayed
unchanged.  :func:`serve` starts either as a subprocess and waits until it answers.

The game: ``reset(seed)`` picks a digit from the seed and asks for it; each ``step`` takes the
first digit of the action's ``message``: right earns 1.0 and ends the episode, wrong earns 0
and says "higher" or "lower"; the episode ends after three guesses.
"""

# no ``from __future__ import annotations``: FastAPI reads the relay's parameter annotations
# at run time, and the WebSocket class is imported inside the function that builds it.
import argparse
import contextlib
import random
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

MAX_GUESSES = 3


def build_app() -> Any:
    """The game as an OpenEnv FastAPI app (imports openenv-core: the test extra)."""
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class GuessAction(Action):
        message: str = Field(description="the policy's reply; its first digit is the guess")

    class GuessObservation(Observation):
        prompt: str = ""
        guesses_left: int = MAX_GUESSES

    class GuessState(State):
        target: int = 0

    class DigitGuess(Environment[GuessAction, GuessObservation, GuessState]):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state = GuessState()

        def reset(
            self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
        ) -> GuessObservation:
            target = random.Random(seed).randrange(10)
            self._state = GuessState(episode_id=episode_id, step_count=0, target=target)
            return GuessObservation(prompt="Guess my digit (0-9).", reward=None, done=False)

        def step(
            self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any
        ) -> GuessObservation:
            state = self._state
            state.step_count += 1
            left = MAX_GUESSES - state.step_count
            found = re.search(r"\d", action.message)
            if found is not None and int(found.group()) == state.target:
                return GuessObservation(prompt="Right!", guesses_left=left, reward=1.0, done=True)
            hint = (
                "no digit"
                if found is None
                else ("higher" if int(found.group()) < state.target else "lower")
            )
            return GuessObservation(
                prompt=f"Wrong ({hint}). Guess again.", guesses_left=left, reward=0.0,
                done=left <= 0,
            )  # fmt: skip

        @property
        def state(self) -> GuessState:
            return self._state

    return create_app(
        DigitGuess, GuessAction, GuessObservation, env_name="digit_guess", max_concurrent_envs=256
    )


def build_unreliable_app(upstream: str) -> Any:
    """A relay in front of the game at ``upstream`` that fails some episodes (module doc)."""
    import asyncio
    import json

    from fastapi import FastAPI, WebSocket
    from websockets.asyncio.client import connect

    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "healthy"}

    @app.websocket("/ws")
    async def relay(client: WebSocket) -> None:
        await client.accept()
        url = upstream.replace("http://", "ws://", 1).rstrip("/") + "/ws"
        async with connect(url) as game:
            fault = None
            while True:
                try:
                    frame = await client.receive_text()
                except Exception:
                    return
                message = json.loads(frame)
                if message.get("type") == "reset":
                    fault = int(message.get("data", {}).get("seed", 0)) % 3
                elif message.get("type") == "step" and fault == 0:
                    await client.send_text("<html>502 Bad Gateway</html>")
                    continue
                elif message.get("type") == "step" and fault == 1:
                    await client.close(code=1011)
                    return
                await game.send(frame)
                if message.get("type") == "close":
                    with contextlib.suppress(Exception):
                        await client.close()
                    return
                await client.send_text(await asyncio.wait_for(game.recv(), 30))

    return app


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def serve(unreliable_of: str | None = None, timeout_s: float = 120.0) -> Iterator[str]:
    """The game (or the unreliable relay in front of ``unreliable_of``) in a subprocess on a
    free loopback port; yields its base URL and stops it afterwards."""
    port = free_port()
    command = [sys.executable, "-m", "hf_testing.openenv_game", "--port", str(port)]
    if unreliable_of:
        command += ["--unreliable-of", unreliable_of]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the OpenEnv test server exited with {process.returncode}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the OpenEnv test server on {url} never answered") from None
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--unreliable-of", default=None, help="relay to this game, failing some")
    args = parser.parse_args(argv)
    app = build_unreliable_app(args.unreliable_of) if args.unreliable_of else build_app()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
