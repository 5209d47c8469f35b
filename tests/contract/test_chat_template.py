"""Chat only where the checkpoint has a chat template or --chat-template gives one (vLLM's
flag and behaviour, issue 51 item 6): the offline Gemma 3 270M is a base model without one, so
its chat is a 400 naming the flag while completions serve; a template given by the flag (file
or inline) makes chat render through it; SmolLM2's own template still serves chat."""
from __future__ import annotations

import pytest
from test_gateway import EOS, MODEL, FakeVerifier, gateway, responses

from gateway.chat_template import load_chat_template
from tools.cli import build_parser
from tools.up_flags import up_config

pytestmark = pytest.mark.contract
MESSAGES = [{"role": "user", "content": "Name a river."}]
# A turn format of our own, so the test sees that this template, not another, was applied
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture()
def verifier(loop_thread, tokenizer):
    """A fake verifier that answers ' the Danube' + EOS and records each request."""
    ids = tokenizer.encode(" the Danube", add_special_tokens=False) + [EOS]

    async def script(fake, request, context):
        for resp in responses([ids[i:i + 2] for i in range(0, len(ids), 2)]):
            yield resp

    fake = FakeVerifier(script)
    loop_thread.run(fake.start())
    yield fake
    loop_thread.run(fake.server.stop(None))


def _chat(client):
    return client.post("/v1/chat/completions",
                       json={"model": MODEL, "max_tokens": 8, "messages": MESSAGES})


def test_the_offline_gemma_is_a_base_model_without_a_chat_template(gemma_paths):
    """Neither where transformers reads one, nor the turn template Tandem once wrote (an
    older cache's is removed when the model is resolved)."""
    import json

    root = gemma_paths.root
    assert not (root / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((root / "tokenizer_config.json").read_text())


def test_chat_without_a_template_is_a_400_naming_the_flag_and_completions_serve(
        redis_proc, tokenizer, prefix, verifier):
    base = type(tokenizer).from_pretrained(tokenizer.name_or_path)  # the same, untemplated
    base.chat_template = None
    with gateway(redis_proc, base, prefix, static_verifiers=(verifier.address,)) as client:
        for stream in (False, True):
            resp = client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 8, "messages": MESSAGES, "stream": stream})
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]  # OpenAI's error object, as the gateway's other 400s
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "invalid_request_error"
            assert err["code"] == "chat_template_missing" and err["param"] == "messages"
            assert "--chat-template" in err["message"] and "/v1/completions" in err["message"]
        assert not verifier.requests  # refused before anything was generated
        resp = client.post("/v1/completions",
                           json={"model": MODEL, "max_tokens": 8, "prompt": "The longest river"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == " the Danube"


def test_chat_template_flag_makes_chat_render_through_it(redis_proc, tokenizer, prefix,
                                                         verifier, tmp_path):
    base = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    base.chat_template = None
    path = tmp_path / "turns.jinja"
    path.write_text(TEMPLATE)
    inline = TEMPLATE.replace("\n", "\\n")  # one line, as a shell would pass it
    for given in (str(path), inline):
        template = load_chat_template(given)
        assert template == TEMPLATE
        with gateway(redis_proc, base, prefix, static_verifiers=(verifier.address,),
                     chat_template=template) as client:
            resp = _chat(client)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == " the Danube"
        want = base("[user] Name a river.\n[assistant] ").input_ids
        assert list(verifier.requests[-1].prompt_token_ids) == want
    assert base.chat_template is None  # the caller's tokenizer is left as it was


def test_a_checkpoint_with_a_template_still_serves_chat(redis_proc, tokenizer, prefix,
                                                        verifier):
    assert tokenizer.chat_template  # SmolLM2-135M-Instruct ships one
    with gateway(redis_proc, tokenizer, prefix, static_verifiers=(verifier.address,)) as client:
        resp = _chat(client)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == " the Danube"
    want = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    assert list(verifier.requests[-1].prompt_token_ids) == list(want)


def test_the_flag_on_tandem_gateway_and_tandem_up(tmp_path):
    from gateway.cli import build_config

    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    assert load_chat_template("") is None
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    args = build_parser().parse_args(["gateway", "--chat-template", str(path)])
    assert build_config(args, "redis://127.0.0.1:1/0", tmp_path).chat_template == TEMPLATE
    args = build_parser().parse_args(["gateway"])
    assert build_config(args, "redis://127.0.0.1:1/0", tmp_path).chat_template == ""
    up = up_config(build_parser().parse_args(["up", "--chat-template", str(path)]))
    assert up.gateway_args == ("--chat-template", str(path))
    assert up_config(build_parser().parse_args(["up"])).gateway_args == ()


def test_the_turn_template_tandem_once_wrote_is_removed_from_a_cache(tmp_path):
    from tandem.models import _retire_templates

    old = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = "
           "messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}{% else %}"
           "{% set prefix = '' %}{% set turns = messages %}{% endif %}{% for m in turns %}"
           "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
           "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + "
           "m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
    (tmp_path / "chat_template.jinja").write_text(old)
    _retire_templates(tmp_path)
    assert not (tmp_path / "chat_template.jinja").exists()
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)  # a checkpoint's own: kept
    _retire_templates(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text() == TEMPLATE
