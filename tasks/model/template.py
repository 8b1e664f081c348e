"""Whether a model's chat template renders the conversations the pipeline builds, checked before any stage.

Every prompt is ``[system (data.system_prompt, when set), user]`` (tasks/dataio/rows.py), SFT adds the assistant
turn. Some templates refuse a role: Gemma's raises jinja's ``TemplateError("System role not supported")``, which
otherwise surfaces raw from SFT after the data stage. :func:`chat_template_problem` renders one tiny conversation
of that shape with the tokenizer the stages load (tasks/model/loading.py: ChatML when the folder has none) and
returns why it fails, naming the model and the config key to change.
"""

from __future__ import annotations

from grpoflow.tasks.config import ModelConfig

PROBE_QUESTION = "What is 1 + 2?"
PROBE_ANSWER = "<reasoning>\n1 + 2 = 3\n</reasoning>\n<answer>\n3\n</answer>"


def _render(tokenizer, messages: list[dict]) -> None:
    tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": PROBE_ANSWER}], tokenize=False)


def chat_template_problem(folder: str, model: ModelConfig, system_prompt: str | None) -> str | None:
    """Why the chat template of the model in ``folder`` (the value of model.name) cannot render a prompt with
    ``system_prompt`` (data.system_prompt); None when it can."""
    from grpoflow.tasks.model.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(folder, model)
    except Exception as e:  # a tokenizer_config.json that does not parse, a class transformers lacks: its words
        return f"model.name: {folder}: the tokenizer does not load ({type(e).__name__}: {e})"
    user = [{"role": "user", "content": PROBE_QUESTION}]
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    try:
        _render(tokenizer, system + user)
        return None
    except Exception as e:  # jinja2's TemplateError (raise_exception in the template), or a template bug
        said = f"{type(e).__name__}: {e}"
    if system:
        try:
            _render(tokenizer, user)
        except Exception:
            pass
        else:
            return (
                f"model.name: {folder}: its chat template refuses a system turn ({said}), and data.system_prompt "
                "is set; set data.system_prompt=null (and put the format instructions in the questions), or use a "
                "model whose template takes a system role"
            )
    return f"model.name: {folder}: its chat template cannot render a [user, assistant] conversation ({said})"
