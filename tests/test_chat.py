"""Multi-turn generation on one cache (continue_generation, ChatSession) and the `h2o-kv chat` command."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from helpers import quiet_generate

from h2o_kv import H2OCache
from h2o_kv.chat import ChatSession, continue_generation
from h2o_kv.chat_terminal import run_chat
from h2o_kv.hf.cache import H2OBudgetWarning
from h2o_kv.models import load_model


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_model(tiny_models["llama"])[0]


@pytest.mark.parametrize("streaming", [False, True])
def test_continue_generation_equals_generating_over_the_full_history(llama, streaming):
    """Turn 2 fed alone on the turn-1 cache gives the tokens of one generate over the whole history."""
    gen = torch.Generator().manual_seed(0)
    turn1, turn2 = torch.randint(3, 512, (1, 20), generator=gen), torch.randint(3, 512, (1, 12), generator=gen)
    cache = H2OCache(heavy=100, recent=100, streaming=streaming)
    options = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=H2OBudgetWarning)
        first = continue_generation(llama, cache, turn1, **options)
        assert cache.get_seq_length() == 30  # the last generated token was fed as well
        second = continue_generation(llama, cache, turn2, **options)
    assert torch.equal(second[:, :12], turn2)  # sequences = the new tokens + the reply
    history = torch.cat([first, turn2], dim=1)
    reference = quiet_generate(llama, history, H2OCache(heavy=100, recent=100), 10)
    assert torch.equal(second[:, 12:], reference[:, history.shape[1] :])
    assert cache.get_seq_length() == history.shape[1] + 10  # every returned token is in the cache


def test_continue_generation_after_plain_generate_and_without_feed_last(llama):
    """After a plain generate (or feed_last=False) the unfed last token goes in front of the next turn."""
    gen = torch.Generator().manual_seed(1)
    turn1, turn2 = torch.randint(3, 512, (1, 10), generator=gen), torch.randint(3, 512, (1, 6), generator=gen)
    opts = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    outs = []
    for how in ("helper", "plain", "no-feed"):
        cache = H2OCache(heavy=64, recent=64, streaming=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=H2OBudgetWarning)
            if how == "helper":
                continue_generation(llama, cache, turn1, **opts)
                nxt = turn2
            else:
                if how == "plain":
                    first = quiet_generate(llama, turn1, cache, 5)
                else:
                    first = continue_generation(llama, cache, turn1, feed_last=False, **opts)
                assert cache.get_seq_length() == 14
                nxt = torch.cat([first[:, -1:], turn2], dim=1)
            outs.append(continue_generation(llama, cache, nxt, **opts)[:, -5:])
        assert cache.get_seq_length() == 10 + 5 + 6 + 5
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_continue_generation_with_eviction_stays_bounded(llama):
    cache = H2OCache(heavy=8, recent=8, streaming=True)
    for seed in range(6):  # 6 turns of 30 + 20 tokens: far more than the 16 kept entries
        turn = torch.randint(3, 512, (1, 30), generator=torch.Generator().manual_seed(seed))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=H2OBudgetWarning)
            out = continue_generation(
                llama, cache, turn, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0
            )
        assert out.shape == (1, 50)
    stats = cache.stats()
    assert stats["seen_tokens"] == 6 * 50 and stats["kv_tokens"] == 16 and stats["slots"] <= 17


def test_continue_generation_full_history_mask_matches_new_only(llama):
    gen = torch.Generator().manual_seed(5)
    turn1, turn2 = torch.randint(3, 512, (1, 16), generator=gen), torch.randint(3, 512, (1, 8), generator=gen)
    outs = []
    for full_mask in (False, True):
        cache = H2OCache(heavy=64, recent=64)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=H2OBudgetWarning)
            continue_generation(llama, cache, turn1, max_new_tokens=5, do_sample=False)
        seen = cache.get_seq_length()
        mask = torch.ones(1, seen + 8 if full_mask else 8, dtype=torch.long)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=H2OBudgetWarning)
            outs.append(continue_generation(llama, cache, turn2, mask, max_new_tokens=6, do_sample=False))
    assert torch.equal(outs[0], outs[1])


def test_continue_generation_bad_input(llama):
    cache = H2OCache(heavy=4, recent=4)
    with pytest.raises(ValueError, match="n >= 1 new tokens"):
        continue_generation(llama, cache, torch.zeros(1, 0, dtype=torch.long))
    quiet_generate(llama, torch.randint(3, 512, (1, 6)), cache, 2)
    with pytest.raises(ValueError, match="attention_mask must cover"):
        continue_generation(llama, cache, torch.ones(1, 3, dtype=torch.long), torch.ones(1, 5, dtype=torch.long))


# -- the real default model --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(default_model):
    return default_model


def test_chat_turn_text_follows_the_template(smol):
    model, tok = smol
    session = ChatSession(model, tok, heavy=16, recent=16, max_new_tokens=4)
    first = session.turn_text("Hi")
    assert first == tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    session.turns, session._reply_closed = 1, True  # after a reply that ended with <|im_end|>
    assert session.turn_text("Next") == "\n<|im_start|>user\nNext<|im_end|>\n<|im_start|>assistant\n"
    session._reply_closed = False  # a reply cut short (max_new_tokens, Ctrl-C) is closed by the template
    assert session.turn_text("Next").startswith("<|im_end|>\n<|im_start|>user\n")


@pytest.mark.slow
def test_chat_session_is_bounded_over_many_turns(smol):
    model, tok = smol
    session = ChatSession(model, tok, heavy=16, recent=16, max_new_tokens=6)
    out = io.StringIO()
    for question in ("What is 2 + 2?", "And 3 + 3?", "Name a colour.", "Name a fruit."):
        result = session.send(question, out=out)
        assert result["new_tokens"] >= 1 and not result["interrupted"]
        assert result["reply"] and result["reply"] in out.getvalue()
    stats = session.stats()
    assert stats["turns"] == 4 and stats["streaming"]
    assert stats["seen_tokens"] > 60 and stats["kv_tokens"] == 32 and stats["slots"] <= 33
    with pytest.raises(ValueError, match="empty message"):
        session.send("   ")
    session.reset()
    assert session.stats()["seen_tokens"] == 0 and session.turns == 0


def test_short_chat_holds_no_more_kv_memory_than_a_full_cache(smol):
    """Below the budget the buffer grows with the entries (it used to be allocated at heavy + recent + 1 at once)."""
    model, tok = smol
    session = ChatSession(model, tok, max_new_tokens=4)  # the command's default budget, 256 + 256
    for question in ("Hi", "And you?"):
        session.send(question)
        stats = session.stats()
        assert stats["kv_tokens"] == stats["seen_tokens"] < 512
        assert stats["kv_bytes"] <= stats["full_kv_bytes"], stats


def test_chat_session_bad_settings(smol):
    model, tok = smol
    with pytest.raises(ValueError, match="heavy \\+ recent must be >= 1"):
        ChatSession(model, tok, heavy=0, recent=0)
    with pytest.raises(ValueError, match="bounded policy"):
        ChatSession(model, tok, policy="full")
    with pytest.raises(ValueError, match="chat template"):
        ChatSession(model, None)


def test_run_chat_survives_bad_lines(smol):
    model, tok = smol
    session = ChatSession(model, tok, heavy=16, recent=16, max_new_tokens=4)
    script = io.StringIO("\n   \n/nope\nHello\n/stats\n/reset\n/stats\n")
    out = io.StringIO()
    assert run_chat(session, stdin=script, out=out) == 1  # EOF ends the loop like /quit
    text = out.getvalue()
    assert text.count("empty message ignored") == 2 and "unknown command '/nope'" in text
    assert "held" in text and "seen_tokens: 0" in text and "conversation forgotten" in text


def _chat_process(*args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "h2o_kv.cli", "chat", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip


@pytest.mark.slow
def test_piped_multi_turn_chat_end_to_end(default_model):
    """A scripted session through the command: three turns with eviction, commands, a non-UTF-8 line."""
    script = b"What is the capital of France?\n\n/stats\nAnd of Italy?\n\xff\xfe odd bytes\n/bogus\n/quit\nignored\n"
    proc = _chat_process("--heavy", "24", "--recent", "24", "--max-new-tokens", "12")
    out, _ = proc.communicate(script, timeout=240)
    text = out.decode("utf-8", errors="replace")
    assert proc.returncode == 0, text
    assert text.count("bot> ") == 3 and text.count("held ") == 3  # three answered turns, one status line each
    assert "Paris" in text
    assert "empty message ignored" in text and "unknown command '/bogus'" in text and "kv_tokens:" in text
    assert "ignored\nbot>" not in text  # nothing after /quit is read
    held = [int(part.split(" entries")[0]) for part in text.split("held ")[1:]]
    seen = [int(part.split(" tokens")[0]) for part in text.split("| seen ")[1:]]
    assert max(held) <= 48 < seen[-1]  # evicting, bounded


@pytest.mark.slow
def test_ctrl_c_stops_the_reply_not_the_session(default_model):
    proc = _chat_process("--heavy", "16", "--recent", "16", "--max-new-tokens", "400", "--policy", "sink")
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read(1), b"")), daemon=True)
    reader.start()
    proc.stdin.write(b"Write a very long story about a dragon and a knight.\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and b"".join(chunks).count(b" ") < 40:  # wait until the reply is flowing
        time.sleep(0.2)
    assert b"bot> " in b"".join(chunks), b"".join(chunks).decode(errors="replace")
    proc.send_signal(signal.SIGINT)
    proc.stdin.write(b"/stats\n/quit\n")
    proc.stdin.flush()
    proc.stdin.close()
    assert proc.wait(timeout=120) == 0
    reader.join(timeout=10)
    text = b"".join(chunks).decode(errors="replace")
    assert "| stopped]" in text and "kv_tokens:" in text
