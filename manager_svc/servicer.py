"""Thin gRPC adapter of the public Generation API over the scheduler: validate and convert the
request, submit it, stream its chunks; leaving the stream (cancel, deadline) cancels it."""

from __future__ import annotations

from tokenizers import Tokenizer

from specinfer.engine import Chunk
from specinfer.engine import Request, validate
from specinfer.errors import check_token_ids
from specinfer.tree import validate_expansion
from specinfer_rpc.convert import grammar_from_pb, sampling_from_pb
from specinfer_rpc.server import rpc_errors
from specinfer_rpc.v1 import generation_pb2, generation_pb2_grpc

from .scheduler import Scheduler, Stream

FINISH = {"eos": generation_pb2.FINISH_REASON_EOS, "stop": generation_pb2.FINISH_REASON_STOP,
          "length": generation_pb2.FINISH_REASON_LENGTH}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, info: generation_pb2.ModelInfo):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.info = info

    def request_from_pb(self, pb: generation_pb2.GenerateRequest) -> tuple[Request, list[int] | None]:
        """The core request and its expansion (None: the server's); ValueError names a bad field.
        max_new_tokens unset: the server's default, else the rest of the context."""
        stopping, context = pb.stopping, self.info.context_length
        if not stopping.max_new_tokens and len(pb.prompt_token_ids) >= context:
            raise ValueError(f"prompt: {len(pb.prompt_token_ids)} tokens leave no room for output in the "
                             f"context length {context}")
        request = Request(list(pb.prompt_token_ids),
                          stopping.max_new_tokens or self.info.default_max_new_tokens
                          or context - len(pb.prompt_token_ids),
                          sampling_from_pb(pb.sampling), tuple(stopping.stop_token_ids), stopping.ignore_eos,
                          pb.request_id, pb.return_logprobs, pb.return_prompt_logprobs, pb.top_logprobs,
                          grammar_from_pb(pb.response_format), pb.priority, tuple(pb.prediction_token_ids))
        validate(request, self.info.vocab_size, context, self.info.max_new_tokens_cap or None)
        mode = pb.speculation.mode
        if mode == generation_pb2.SPECULATION_MODE_OFF:
            return request, []
        if mode == generation_pb2.SPECULATION_MODE_FIXED:
            if not pb.speculation.expansion:
                raise ValueError("speculation.expansion: must not be empty with SPECULATION_MODE_FIXED")
            validate_expansion(list(pb.speculation.expansion), "speculation.expansion")
            return request, list(pb.speculation.expansion)
        if mode != generation_pb2.SPECULATION_MODE_UNSPECIFIED:
            raise ValueError(f"speculation.mode: unknown value {mode}")
        if pb.speculation.expansion:
            raise ValueError("speculation.expansion: only allowed with SPECULATION_MODE_FIXED")
        return request, None

    @rpc_errors
    async def Generate(self, request: generation_pb2.GenerateRequest, context):
        seq = self.scheduler.submit(*self.request_from_pb(request), want_trees=request.return_draft_trees,
                                    fit_max_new_tokens=not (request.stopping.max_new_tokens
                                                            or self.info.default_max_new_tokens))
        try:
            while True:
                event = await seq.events.get()
                if isinstance(event, Exception):
                    raise event
                yield self.chunk_to_pb(seq, event)
                if event.finish_reason:
                    return
        finally:
            self.scheduler.cancel(seq)

    @staticmethod
    def chunk_to_pb(seq: Stream, chunk: Chunk) -> generation_pb2.GenerateResponse:
        response = generation_pb2.GenerateResponse(token_ids=chunk.tokens, logprobs=chunk.logprobs,
                                                   prompt_logprobs=chunk.prompt_logprobs,
                                                   accepted_prediction_tokens=chunk.prediction[0],
                                                   rejected_prediction_tokens=chunk.prediction[1])
        if seq.want_trees and chunk.tree is not None:
            response.draft_tree.CopyFrom(generation_pb2.DraftTreeStep(
                token_ids=chunk.tree.tokens, parents=chunk.tree.parents, speculators=chunk.proposers,
                accepted=chunk.accepted_nodes))
        if chunk.finish_reason:
            response.finish_reason = FINISH[chunk.finish_reason]
            reasons = seq.no_tree.most_common(1)
            response.usage.CopyFrom(generation_pb2.Usage(
                prompt_tokens=len(seq.request.prompt), completion_tokens=len(seq.generated),
                verifier_steps=seq.steps, mean_tokens_per_step=len(seq.generated) / seq.steps,
                accepted_draft_tokens=sum(seq.accepted), tree_steps=seq.tree_steps,
                no_tree_reason=reasons[0][0] if reasons else "", cached_tokens=seq.cached_tokens,
                preemptions=seq.preemptions,
                accepted_prediction_tokens=seq.prediction.accepted if seq.prediction is not None else 0,
                rejected_prediction_tokens=seq.prediction.rejected if seq.prediction is not None else 0))
        return response

    @rpc_errors
    async def GetModelInfo(self, request, context) -> generation_pb2.ModelInfo:
        info = generation_pb2.ModelInfo()
        info.CopyFrom(self.info)
        info.speculators = sum(d.connected for d in self.scheduler.engine.drafters)
        info.drafter_names[:] = [d.name for d in self.scheduler.engine.drafters]
        return info

    @rpc_errors
    async def Tokenize(self, request, context) -> generation_pb2.TokenizeResponse:
        return generation_pb2.TokenizeResponse(token_ids=self.tokenizer.encode(request.text).ids)

    @rpc_errors
    async def Detokenize(self, request, context) -> generation_pb2.DetokenizeResponse:
        ids = list(request.token_ids)
        check_token_ids("token_ids", ids, self.info.vocab_size)
        return generation_pb2.DetokenizeResponse(text=self.tokenizer.decode(ids))
