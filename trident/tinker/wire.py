"""The Tinker wire codec: every byte the SDK (``tinker==0.38.*``, pinned) sends or receives passes
through here, and nothing else in trident imports the SDK's types.

What the SDK speaks (its ``proto/request_conv.py``, ``proto/response_conv.py`` and
``resources/*.py``):

- JSON bodies for every endpoint but one, parsed and answered through the SDK's own
  ``tinker.types`` pydantic models, so a field the pinned SDK renames fails here, loudly;
- ``forward_backward``: a protobuf ``ForwardBackwardRequest`` (``tinker.proto.tinker_public_pb2``),
  zstd-compressed when the request says ``Content-Encoding: zstd``. Tensors arrive dense or
  sparse CSR (values, row pointers, column indices; unlisted cells are 0), float32 or int64;
  token chunks are int32 and concatenate into one sequence; image and audio chunks are refused
  (trident serves text models). ``loss_fn_config_v2`` wins over the legacy float map when set;
  provenance spans are ignored (only the unpublished ``stable_reinforce`` reads them);
- results of ``ForwardBackwardOutput`` and ``SampleResponse`` as protobuf (the SDK raises on
  JSON for these two): one ``ArrayRecord`` whose fields are per-datum tensors cut by byte
  offsets; prompt logprobs with NaN where none exists (position 0); top-k as dense ``N x K``
  matrices padded with token 0 / logprob -99999.

``decode_call`` turns a training request into what the service journals and applies
(``Call``: model id, seq id, decoded arguments), one rule per kind:

- ``create_model``: seq 0; ``{"base_model", "lora": LoraShape | None, "user_metadata",
  "session_id", "model_seq_id"}``;
- ``load_weights``: seq 0 when it creates the model (``session_id`` + ``model_seq_id``), else the
  client's; ``{"path", "optimizer", "base_model", "user_metadata"}``;
- ``forward_backward``: a ``ForwardBackwardCall``; ``optim_step``: trident's ``AdamParams``;
- ``save_weights``: ``{"path", "ttl_seconds", "overwrite", "user_metadata"}``;
- ``save_weights_for_sampler``: ``{"path", "sampling_session_seq_id", "kind", "ttl_seconds",
  "user_metadata"}`` (no path: a push to the samplers, answered with a sampling session id).

Every call on an existing model carries the client's seq id (1, 2, ...).

A new model's id is ``f"{session_id}:train:{model_seq_id}"``, the SDK's own derivation
(``service_client.py``), for ``create_model`` and create-via-load alike. ``lora`` is None for full
fine-tuning (no ``lora_config``, or rank 0, SkyRL's convention); LoRA alpha is not on the wire and
comes from ``tinker.lora_alpha``; the LoRA init seed is not honoured (the run's seed is).

A request the codec cannot read raises ``WireError``: the client's mistake, answered 400 with the
message before anything is journaled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import pydantic
import torch
import zstandard
from tinker import types as sdk
from tinker.proto import tinker_public_pb2 as pb

from trident.tinker.journal import model_id_of
from trident.train.datum import AdamParams, Datum, LoraShape

PROTO_CONTENT_TYPE = "application/x-protobuf"
# The SDK's sentinel for an empty top-k cell (tinker/types/topk_logprobs.py: MASK_LOGPROB).
TOPK_EMPTY_LOGPROB = -99999.0

_NUMPY_DTYPE = {pb.DTYPE_FLOAT32: np.dtype(np.float32), pb.DTYPE_INT64: np.dtype(np.int64)}
_PROTO_DTYPE = {torch.float32: pb.DTYPE_FLOAT32, torch.int64: pb.DTYPE_INT64}
_STOP_REASON = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}

M = TypeVar("M", bound=pydantic.BaseModel)


class WireError(ValueError):
    """A request the codec cannot decode; the message says what and where (HTTP 400)."""


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded ``forward_backward`` request: the trainer's ``Datum`` list and the loss to run."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    data: list[Datum]
    forward_only: bool


@dataclass(frozen=True)
class Call:
    """A training request as the service journals it (see the module's table)."""

    kind: str
    model_id: str
    seq_id: int
    args: Any


@dataclass(frozen=True)
class SampledOutput:
    """One sampled sequence to encode: tokens through the stop sequence, their logprobs, why
    generation stopped, and per position the top-k ``(token_id, logprob)`` pairs if asked."""

    tokens: Sequence[int]
    logprobs: Sequence[float] | None
    stop_reason: Literal["stop", "length"]
    topk: Sequence[Sequence[tuple[int, float]] | None] | None = None


@dataclass(frozen=True)
class SampleCall:
    """A decoded ``asample`` request in trident's terms: the prompt's token ids and how to
    sample them. ``stop`` is strings or token ids (the SDK sends either); ``top_k`` -1 is off;
    the ``topk_*`` counts are 0 when not asked; ``prompt_logprobs_last_n`` None scores the whole
    prompt."""

    sampling_session_id: str
    seq_id: int
    num_samples: int
    prompt_tokens: list[int]
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str] | list[int] | None
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    topk_sample_logprobs: int
    prompt_logprobs_last_n: int | None


# --- JSON bodies -------------------------------------------------------------------------------


def parse_json(model: type[M], body: bytes) -> M:
    """A JSON request body through the SDK's own request model (unknown fields are errors, as
    the SDK's ``StrictBase`` says)."""
    try:
        return model.model_validate_json(body or b"{}")
    except pydantic.ValidationError as e:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()
        )
        raise WireError(f"{model.__name__}: {errors}") from None


def dump_json(model: pydantic.BaseModel) -> dict[str, Any]:
    """A response model as the JSON the SDK parses."""
    return model.model_dump(mode="json", exclude_none=True)


def get_info_response(info: dict[str, Any]) -> dict[str, Any]:
    """``get_info``'s answer from the service's model info (``model_id``, ``base_model``,
    ``is_lora``, ``lora_rank``, optional ``tokenizer_id`` and ``arch``). The tokenizer id may be
    a local directory: the SDK loads it with ``AutoTokenizer``."""
    return dump_json(
        sdk.GetInfoResponse(
            type="get_info",
            model_id=info["model_id"],
            model_name=info["base_model"],
            is_lora=info["is_lora"],
            lora_rank=info.get("lora_rank"),
            model_data=sdk.ModelData(
                model_name=info["base_model"],
                tokenizer_id=info.get("tokenizer_id", info["base_model"]),
                arch=info.get("arch"),
            ),
        )
    )


def training_run_response(info: dict[str, Any]) -> dict[str, Any]:
    """``GET training_runs/{id}``'s answer from the same model info (plus optional
    ``last_request_time``, ``user_metadata`` and ``model_owner``)."""
    return dump_json(
        sdk.TrainingRun(
            training_run_id=info["model_id"],
            base_model=info["base_model"],
            model_owner=info.get("model_owner", "local"),
            is_lora=info["is_lora"],
            lora_rank=info.get("lora_rank"),
            last_request_time=info.get("last_request_time", "1970-01-01T00:00:00Z"),
            user_metadata=info.get("user_metadata"),
        )
    )


# --- training calls ----------------------------------------------------------------------------


def decode_call(
    kind: str, body: bytes, content_encoding: str | None = None, lora_alpha: float = 32.0
) -> Call:
    """A training request's body, decoded into the ``Call`` the module's table describes. The
    service journals the decompressed body and replays it through this same function."""
    body = decompress(body, content_encoding)
    if kind == "forward_backward":
        fb = decode_forward_backward(body)
        return Call(kind, fb.model_id, fb.seq_id, fb)
    if kind == "create_model":
        return _create_model(parse_json(sdk.CreateModelRequest, body), lora_alpha)
    if kind == "load_weights":
        return _load_weights(parse_json(sdk.LoadWeightsRequest, body))
    if kind == "optim_step":
        req = parse_json(sdk.OptimStepRequest, body)
        if not isinstance(req.optim_params, sdk.AdamParams):
            raise WireError(f"optim_step: only Adam is served, not {req.optim_params.type!r}")
        p = req.optim_params
        adam = AdamParams(
            learning_rate=p.learning_rate,
            beta1=p.beta1,
            beta2=p.beta2,
            eps=p.eps,
            weight_decay=p.weight_decay,
            grad_clip_norm=p.grad_clip_norm,
        )
        return Call(kind, req.model_id, _seq(kind, req.seq_id), adam)
    if kind == "save_weights":
        req = parse_json(sdk.SaveWeightsRequest, body)
        args = req.model_dump(include={"path", "ttl_seconds", "overwrite", "user_metadata"})
        return Call(kind, req.model_id, _seq(kind, req.seq_id), args)
    if kind == "save_weights_for_sampler":
        req = parse_json(sdk.SaveWeightsForSamplerRequest, body)
        fields = {"path", "sampling_session_seq_id", "kind", "ttl_seconds", "user_metadata"}
        return Call(kind, req.model_id, _seq(kind, req.seq_id), req.model_dump(include=fields))
    raise WireError(f"{kind!r} is not a training call")


def _seq(kind: str, seq_id: int | None) -> int:
    # seq 0 is how the proto says "unset"; every request on an existing model carries its
    # TrainingClient's counter (1, 2, ...), the only key that survives the SDK's retries.
    if seq_id is None or seq_id < 1:
        raise WireError(f"{kind}: seq_id must be a positive integer, got {seq_id}")
    return seq_id


def _create_model(req: sdk.CreateModelRequest, lora_alpha: float) -> Call:
    if req.optimizer_config.type != "adamw":
        raise WireError(
            f"create_model: only the adamw optimizer is served, not {req.optimizer_config.type!r}"
        )
    lora = None
    if req.lora_config is not None and req.lora_config.rank > 0:
        c = req.lora_config
        lora = LoraShape(c.rank, lora_alpha, c.train_attn, c.train_mlp, c.train_unembed)
    args = {
        "base_model": req.base_model,
        "lora": lora,
        "user_metadata": req.user_metadata,
        "session_id": req.session_id,
        "model_seq_id": req.model_seq_id,
    }
    return Call("create_model", model_id_of(req.session_id, req.model_seq_id), 0, args)


def _load_weights(req: sdk.LoadWeightsRequest) -> Call:
    args = req.model_dump(include={"path", "optimizer", "base_model", "user_metadata"})
    if req.session_id is not None and req.model_seq_id is not None:
        return Call("load_weights", model_id_of(req.session_id, req.model_seq_id), 0, args)
    if req.model_id is not None:
        return Call("load_weights", req.model_id, _seq("load_weights", req.seq_id), args)
    raise WireError("load_weights: give session_id and model_seq_id, or model_id and seq_id")


def decode_sample(body: bytes) -> SampleCall:
    """An ``asample`` JSON body. Only session-bound requests are served (the SDK's
    ``SamplingClient`` always sends one); image prompts and the prompt-scoring extras
    (``target_prompt_logprobs``, ``prompt_alt_tokens_k``) are refused by name."""
    req = parse_json(sdk.SampleRequest, body)
    if req.sampling_session_id is None or req.seq_id is None:
        raise WireError("asample: sampling_session_id and seq_id are required")
    if req.target_prompt_logprobs is not None or req.prompt_alt_tokens_k:
        raise WireError("asample: target_prompt_logprobs and prompt_alt_tokens_k are not served")
    tokens: list[int] = []
    for chunk in req.prompt.chunks:
        if not isinstance(chunk, sdk.EncodedTextChunk):
            raise WireError(f"asample: a {chunk.type} chunk; trident serves text models")
        tokens.extend(chunk.tokens)
    p = req.sampling_params
    stop = [p.stop] if isinstance(p.stop, str) else (list(p.stop) if p.stop is not None else None)
    return SampleCall(
        sampling_session_id=req.sampling_session_id,
        seq_id=req.seq_id,
        num_samples=req.num_samples,
        prompt_tokens=tokens,
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        stop=stop,  # type: ignore[arg-type]  # homogeneous: the SDK's Union is str or int lists
        prompt_logprobs=bool(req.prompt_logprobs),
        topk_prompt_logprobs=req.topk_prompt_logprobs,
        topk_sample_logprobs=req.topk_sample_logprobs,
        prompt_logprobs_last_n=req.prompt_logprobs_last_n,
    )


def decompress(body: bytes, content_encoding: str | None) -> bytes:
    """A request body as its payload: zstd is read (the SDK compresses ``forward_backward`` when
    the server's ``client/config`` says ``proto_compress_fwdbwd``), no other coding is."""
    if content_encoding in (None, "", "identity"):
        return body
    if content_encoding != "zstd":
        raise WireError(f"unsupported Content-Encoding {content_encoding!r} (zstd is read)")
    try:
        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    except zstandard.ZstdError as e:
        raise WireError(f"not a zstd body ({e})") from None


def decode_forward_backward(
    body: bytes, content_encoding: str | None = None
) -> ForwardBackwardCall:
    """A ``forward_backward`` protobuf body (zstd when ``content_encoding`` says so)."""
    body = decompress(body, content_encoding)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # the protobuf runtime raises its own DecodeError
        raise WireError(f"forward_backward: not a ForwardBackwardRequest protobuf ({e})") from None
    seq_id = _seq("forward_backward", msg.seq_id)
    if not msg.model_id or not msg.loss_fn:
        raise WireError("forward_backward: model_id and loss_fn are required")
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=_loss_fn_config(msg),
        data=[_datum(d, i) for i, d in enumerate(msg.data)],
        forward_only=msg.forward_only,
    )


def _loss_fn_config(msg: pb.ForwardBackwardRequest) -> dict[str, float]:
    # The SDK writes float kwargs to both maps; v2 alone can hold text. Servers prefer v2.
    if not msg.loss_fn_config_v2:
        return dict(msg.loss_fn_config)
    config = {}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise WireError(f"forward_backward: loss_fn_config[{key!r}] must be a number")
        config[key] = value.number
    return config


def _datum(msg: pb.Datum, index: int) -> Datum:
    where = f"forward_backward: data[{index}]"
    tokens = []
    for chunk in msg.model_input:
        arm = chunk.WhichOneof("chunk")
        if arm != "encoded_text":
            raise WireError(
                f"{where}: a {arm} chunk; trident serves text models (token chunks only)"
            )
        tokens.append(_frombuffer(chunk.encoded_text.tokens, np.dtype(np.int32), where))
    input_tokens = torch.from_numpy(
        np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
    ).long()
    loss_inputs = {}
    for name, tensor in msg.loss_fn_inputs.items():
        value = _tensor(tensor, f"{where}.loss_fn_inputs[{name!r}]")
        if value.shape[:1] != input_tokens.shape:
            raise WireError(
                f"{where}.loss_fn_inputs[{name!r}]: {value.shape[0] if value.ndim else 0} values "
                f"for {len(input_tokens)} input tokens (position i of the input predicts "
                "target i: one value per input position)"
            )
        loss_inputs[name] = value
    return Datum(input_tokens=input_tokens, loss_inputs=loss_inputs)


def _frombuffer(data: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise WireError(f"{where}: {len(data)} bytes is not a whole number of {dtype} values")
    return np.frombuffer(data, dtype=dtype).copy()


def _tensor(msg: pb.Tensor, where: str) -> torch.Tensor:
    dtype = _NUMPY_DTYPE.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where}: dtype {pb.DType.Name(msg.dtype)}; float32 and int64 are read")
    shape = list(msg.shape)
    if msg.WhichOneof("encoding") == "sparse_csr":
        array = _dense_from_csr(msg.sparse_csr, dtype, shape, where)
    else:
        array = _frombuffer(msg.dense, dtype, where)
        if shape:
            if math.prod(shape) != array.size:
                raise WireError(f"{where}: {array.size} values for shape {shape}")
            array = array.reshape(shape)
    return torch.from_numpy(array)


def _dense_from_csr(csr: pb.SparseCsr, dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    """A CSR matrix made dense, unlisted cells 0 (the SDK's default pad value)."""
    if len(shape) != 2:
        raise WireError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
    values = _frombuffer(csr.values, dtype, where)
    crow = _frombuffer(csr.crow_indices, np.dtype(np.int64), where)
    col = _frombuffer(csr.col_indices, np.dtype(np.int64), where)
    rows, cols = shape
    valid = (
        len(crow) == rows + 1
        and crow[0] == 0
        and bool(np.all(np.diff(crow) >= 0))
        and crow[-1] == len(col) == len(values)
        and bool(np.all((col >= 0) & (col < cols)))
    )
    if not valid:
        raise WireError(f"{where}: inconsistent sparse CSR indices for shape {shape}")
    dense = np.zeros(shape, dtype=dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


# --- results -----------------------------------------------------------------------------------


def encode_forward_backward_output(
    outputs: Sequence[dict[str, torch.Tensor]], metrics: dict[str, float]
) -> bytes:
    """A ``ForwardBackwardOutput`` protobuf: per-datum tensors (``logprobs``, optionally
    ``elementwise_loss``; every datum with the same fields) and the metrics (``loss:sum``)."""
    record = pb.ArrayRecord(num_datums=len(outputs))
    names = list(outputs[0]) if outputs else []
    for name in names:
        tensors = [out[name].detach().cpu().contiguous() for out in outputs]
        dtype = tensors[0].dtype if tensors[0].dtype in _PROTO_DTYPE else torch.float32
        arrays = [t.to(dtype).numpy() for t in tensors]
        trailing = list(arrays[0].shape[1:])
        if any(list(a.shape[1:]) != trailing for a in arrays):
            raise ValueError(f"output {name!r}: datums differ in trailing shape")
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        record.fields[name].CopyFrom(
            pb.BatchedTensor(
                data=b"".join(a.tobytes() for a in arrays),
                offsets=offsets.tobytes(),
                dtype=_PROTO_DTYPE[dtype],
                trailing_shape=trailing,
            )
        )
    if any(set(out) != set(names) for out in outputs):
        raise ValueError("every datum's output must carry the same fields")
    msg = pb.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[record] if outputs else [],
        metrics={k: float(v) for k, v in metrics.items()},
    )
    return msg.SerializeToString()


def forward_backward_output_json(
    outputs: Sequence[dict[str, torch.Tensor]], metrics: dict[str, float]
) -> dict[str, Any]:
    """The same result as JSON, for a client whose ``Accept`` does not ask for protobuf."""
    records = []
    for out in outputs:
        record = {}
        for name, t in out.items():
            t = t.detach().cpu()
            dtype = "int64" if not t.is_floating_point() else "float32"
            record[name] = {"data": t.flatten().tolist(), "dtype": dtype, "shape": list(t.shape)}
        records.append(record)
    return {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": records,
        "metrics": {k: float(v) for k, v in metrics.items()},
    }


def encode_sample_response(
    sequences: Sequence[SampledOutput],
    prompt_logprobs: Sequence[float | None] | None = None,
    topk_prompt_logprobs: Sequence[Sequence[tuple[int, float]] | None] | None = None,
) -> bytes:
    """A ``SampleResponse`` protobuf. A prompt position without a logprob (``None``: position 0
    always) is sent as NaN, which the SDK reads back as ``None``."""
    msg = pb.SampleResponse()
    for seq in sequences:
        out = msg.sequences.add()
        out.stop_reason = _STOP_REASON[seq.stop_reason]
        out.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        if seq.logprobs is not None:
            out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk is not None:
            out.topk_sampled_logprobs.CopyFrom(_topk(seq.topk))
    if prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if topk_prompt_logprobs is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt_logprobs))
    return msg.SerializeToString()


def _topk(rows: Sequence[Sequence[tuple[int, float]] | None]) -> pb.TopkLogprobs:
    """Per-position ``(token_id, logprob)`` lists as the SDK's dense ``N x K`` matrices; a
    missing position or a short row is padded with the SDK's empty cell."""
    k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), dtype=np.int32)
    logprobs = np.full((len(rows), k), TOPK_EMPTY_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or ()):
            ids[i, j], logprobs[i, j] = token, logprob
    return pb.TopkLogprobs(
        token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows)
    )
