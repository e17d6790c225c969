"""Chat messages as the chat template sees them."""

from tandem.server.protocol import ChatCompletionRequest


def test_assistant_turn_with_only_tool_calls_gets_empty_content():
    """The openai client sends ``content: None`` (or omits it) beside ``tool_calls``; templates that read
    ``message.content`` failed on it, because transformers drops None fields."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for assistant in ({"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "assistant", "tool_calls": [call]}):
        request = ChatCompletionRequest(model="m", messages=[
            {"role": "user", "content": "hi"}, assistant, {"role": "tool", "tool_call_id": "c1", "content": "1"}])
        messages = request.template_messages()
        assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"]["name"] == "f"
        assert messages[2] == {"role": "tool", "content": "1", "tool_call_id": "c1"}


def test_deeply_nested_arguments_in_the_history_are_rendered_as_text():
    """Found over HTTP: ``arguments`` of 5000 nested lists in an earlier call answered 500 RecursionError."""
    arguments = "[" * 5000 + "]" * 5000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    request = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}])
    assert request.template_messages()[1]["tool_calls"][0]["function"]["arguments"] == arguments
