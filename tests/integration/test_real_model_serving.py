"""The real SmolLM2-135M-Instruct through `baton local` and a Python grpcio client generated from
the proto: a chat prompt streams a sensible answer, and the final message's timing breakdown is
present and consistent."""

import grpc
import pytest

from serving_harness import Server, real_model_path


@pytest.fixture(scope="module")
def real_server(baton_bin):
    model = real_model_path()
    s = Server(baton_bin, model)
    yield s
    s.stop_clean()


def test_chat_streams_a_sensible_answer(pb, real_server):
    req = pb.gen.GenerateRequest(messages=[pb.gen.ChatMessage(role="user", content="What is the capital of France?")],
                                 max_tokens=48)
    with grpc.insecure_channel(real_server.address) as ch:
        msgs = list(pb.gen_grpc.GenerationStub(ch).Generate(req, timeout=120))
    text = "".join(m.text for m in msgs)
    print(repr(text))
    assert "Paris" in text
    assert len(msgs) >= 3, "tokens must stream as separate messages"
    final = msgs[-1].final
    assert final.finish_reason in (pb.gen.FINISH_REASON_STOP, pb.gen.FINISH_REASON_LENGTH)
    assert final.usage.prompt_tokens > 10
    assert final.usage.completion_tokens == sum(len(m.token_ids) for m in msgs)
    t = final.timing
    for name in ("queue_seconds", "prefill_seconds", "kv_transfer_seconds", "ttft_seconds", "e2e_seconds"):
        assert getattr(t, name) > 0, name
    assert t.ttft_seconds >= t.queue_seconds + t.prefill_seconds
    assert t.e2e_seconds >= t.ttft_seconds


def test_stop_string_ends_the_text_before_it(pb, real_server):
    req = pb.gen.GenerateRequest(messages=[pb.gen.ChatMessage(role="user", content="Count from 1 to 20, separated by commas.")],
                                 max_tokens=96, stop=["7"])
    with grpc.insecure_channel(real_server.address) as ch:
        msgs = list(pb.gen_grpc.GenerationStub(ch).Generate(req, timeout=120))
    text = "".join(m.text for m in msgs)
    print(repr(text))
    assert "7" not in text
    assert "6" in text
    assert msgs[-1].final.finish_reason == pb.gen.FINISH_REASON_STOP
