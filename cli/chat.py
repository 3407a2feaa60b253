"""pyggml-chat: talk to a GGUF model, one answer (-p) or an interactive conversation."""
from __future__ import annotations

import sys

import click

from pyggml.models.chat import NAMED_TEMPLATES, ChatTemplate

from .common import (Terminal, fail, load_model_or_exit, model_options, setup_logging, show_devices_option,
                     version_option)
from .common import show_devices as show_devices_and_exit


CTX_DEFAULT = 2048


def _print_timings(model) -> None:
    t = model.timings
    pp = t.prompt_tokens / t.prompt_seconds if t.prompt_seconds else 0.0
    tg = t.gen_tokens / t.gen_seconds if t.gen_seconds else 0.0
    click.echo(f"\nprompt eval: {t.prompt_tokens} tokens in {t.prompt_seconds * 1000:.0f} ms ({pp:.1f} tokens/s)\n"
               f"generation:  {t.gen_tokens} tokens in {t.gen_seconds * 1000:.0f} ms ({tg:.1f} tokens/s)", err=True)


def _stream(pieces, piece_of) -> str:
    """Print each piece's text to stdout as it comes; Ctrl-C stops it (what came is kept)."""
    parts: list[str] = []
    try:
        for p in pieces:
            piece = piece_of(p)
            if piece:
                parts.append(piece)
                click.echo(piece, nl=False)
                sys.stdout.flush()
                Terminal.mid_line = not piece.endswith("\n")
    except KeyboardInterrupt:
        click.echo(" [stopped]", nl=False)
    click.echo()
    Terminal.mid_line = False
    return "".join(parts)


def _answer(model, messages: list[dict], sampling: dict, show_reasoning: bool = False) -> str:
    """Stream one answer to a conversation; a reasoning model's reasoning (gpt-oss's analysis
    channel) is left out unless ``show_reasoning``, and then shown dimmed, before the answer.
    Returns the answer (what the conversation keeps)."""
    answer: list[str] = []
    dim = sys.stdout.isatty()

    def piece_of(piece: tuple[str, str]) -> str | None:
        thought, text = piece
        thought = thought if show_reasoning else ""
        answer.append(text)
        shown = (click.style(thought, dim=True) if dim else thought) if thought else ""
        return shown + text or None
    _stream(model.answer(messages, **sampling), piece_of)
    return "".join(answer)


def _continue(model, text: str, sampling: dict) -> None:
    """Stream the continuation of ``text`` (a base model's completion)."""
    _stream(model.complete_text(text, **sampling), lambda piece: piece)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@version_option
@model_options(ctx_default=CTX_DEFAULT)
@click.option("-p", "--prompt", default=None, help="Answer this one message and exit (otherwise: interactive chat).")
@click.option("-sys", "--system", "--system-prompt", "system", default=None,
              help="System message that opens the conversation.")
@click.option("-n", "--n-predict", "n_predict", type=int, default=-1, show_default=True,
              help="Most tokens per answer (-1: until the model stops or the context is full).")
@click.option("--temp", type=float, default=0.8, show_default=True, help="Temperature; 0 = greedy.")
@click.option("--top-k", type=int, default=40, show_default=True, help="Top-k sampling; 0 = off.")
@click.option("--top-p", type=float, default=0.95, show_default=True, help="Top-p (nucleus) sampling; 1 = off.")
@click.option("--min-p", type=float, default=0.05, show_default=True, help="Min-p sampling; 0 = off.")
@click.option("--repeat-penalty", type=float, default=1.0, show_default=True, help="Repetition penalty; 1 = off.")
@click.option("-s", "--seed", type=int, default=None, help="Sampling seed (same seed, same answer).")
@show_devices_option
@click.option("--timings", is_flag=True, help="Print prompt and generation speed after each answer.")
@click.option("--show-reasoning", is_flag=True,
              help="Also print a reasoning model's reasoning (gpt-oss's analysis channel), dimmed, before its answer.")
@click.option("--chat-template", "chat_template", type=click.Choice(sorted(NAMED_TEMPLATES)), default=None,
              help="Talk in this turn format. By default the file's own template; a file with none is a base "
                   "model, whose -p text is continued as given.")
def main(model, ctx_size, ngl, rpc, rpc_key, threads, log_level, loading, prompt, system, n_predict, temp, top_k,
         top_p, min_p, repeat_penalty, seed, show_devices, timings, show_reasoning, chat_template) -> None:
    """Chat with a GGUF model (llama, qwen2, qwen3, qwen3moe, gemma3, gpt-oss).

    With -p, print one streamed answer and exit.  Without it, chat interactively: type a
    message and press Enter; /exit or Ctrl-D quits, Ctrl-C stops the current answer.

    \b
    Examples:
      pyggml-chat                                        # SmolLM2 (downloaded once), interactive
      pyggml-chat -m smollm2 -p "Name three colours." --temp 0
      pyggml-chat -m model.gguf -sys "Answer briefly." -n 128
      pyggml-chat -m model.gguf --rpc "50052;50053" -ngl auto --show-placement
    """
    setup_logging(log_level)
    if show_devices:
        return show_devices_and_exit(rpc, rpc_key, loading)
    m = load_model_or_exit(**loading, path_or_alias=model, n_ctx=ctx_size or CTX_DEFAULT, ngl=ngl, rpc=rpc,
                           rpc_key=rpc_key, seed=seed, n_threads=threads)
    sampling = dict(max_tokens=n_predict if n_predict > 0 else None, temperature=temp, top_k=top_k, top_p=top_p,
                    min_p=min_p, repeat_penalty=repeat_penalty)
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    base = m.chat_template.builtin and chat_template is None  # the file has no turn format: a base model
    if chat_template is not None:
        m.chat_template = ChatTemplate(NAMED_TEMPLATES[chat_template], m.model.hp.arch,
                                       m.chat_template.bos_token, m.chat_template.eos_token)
    try:
        if prompt is not None:
            if base:  # continued as given, as llama.cpp's completion does
                _continue(m, prompt, sampling)
            else:
                _answer(m, messages + [{"role": "user", "content": prompt}], sampling, show_reasoning)
            if timings:
                _print_timings(m)
            return
        if base:
            click.echo(f"note: {m.path.name} has no chat template (a base model?): its answers may ramble; the "
                       f"built-in {m.model.hp.arch} turn format is used (--chat-template picks one).", err=True)
        click.echo(f"{m.describe()}: chat started; /exit or Ctrl-D to quit, Ctrl-C stops an answer.", err=True)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                click.echo()
                break
            if line.strip() in ("/exit", "/quit"):
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            m.timings.reset()
            messages.append({"role": "assistant", "content": _answer(m, messages, sampling, show_reasoning)})
            if timings:
                _print_timings(m)
    except (ValueError, RuntimeError) as e:  # a full context, a template that rejects it, an RPC server lost
        fail(str(e))


if __name__ == "__main__":
    main()
