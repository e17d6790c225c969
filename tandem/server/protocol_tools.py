"""OpenAI request schemas of structured output and tool calling (``response_format``, ``tools``, an
assistant message's ``tool_calls``); ``protocol.py`` uses them in the request models."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.sampling_params import SamplingParamsError, StructuredOutputsParams


class _Model(BaseModel):
    """Ignores unknown fields, refuses NaN/Infinity (as ``protocol.OpenAIModel``; its Unicode check
    runs on the enclosing request)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class JsonSchemaFormat(_Model):
    """``response_format.json_schema``: the schema is enforced whether ``strict`` is true or not (a
    keyword the grammar engine cannot honour is a 400 either way, never a relaxation)."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: str
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint of this format (None for ``text``).

        Raises:
            SamplingParamsError: an unknown type, or ``json_schema`` without a schema (param ``response_format``).
        """
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise SamplingParamsError("response_format of type 'json_schema' needs json_schema.schema",
                                          "response_format")
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        raise SamplingParamsError(f"response_format type must be 'text', 'json_object' or 'json_schema', got "
                                  f"{self.type!r}", "response_format")


class FunctionCallParam(_Model):
    name: str
    arguments: str


class ToolCallParam(_Model):
    """An assistant message's earlier call (``messages[i].tool_calls[j]``)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam

    def to_template(self) -> dict[str, Any]:
        """The call for chat templates: ``arguments`` as an object when it is JSON (what HF templates
        such as Qwen2.5's and Llama 3.1's render), else the text as given."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except (ValueError, RecursionError):
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class FunctionDefinition(_Model):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(_Model):
    type: Literal["function"]
    function: FunctionDefinition
