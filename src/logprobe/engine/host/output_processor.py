"""What happens to a step's picks on the host: each row's token, log probability, top-k and instrument
columns appended to its sequence, then the stop rules (stop tokens, stop strings, max_tokens, the
context), which finish sequences and cut their text. No torch here: the engine runs it after each
pass (core.py) and its test double (tests/fake_backend.py) runs the very same code on its numpy model,
so the API tests check the engine's bookkeeping, not a copy of it. Streaming's releases are in
streaming.py, the columns a finished group hands back in request.py.
"""

from __future__ import annotations

from ...backend import FinishReason
from .picks import Pick
from .request import RowLog, SequenceGroup, SequenceState


class OutputProcessor:
    def __init__(self, context_length: int):
        self.context_length = context_length  # prompt + generated tokens a sequence may hold

    def start_decoding(self, group: SequenceGroup) -> None:
        """The prompt is done: every choice gets a row (they all continue the same prompt)."""
        group.active_rows = [seq.index for seq in group.sequences]

    def record(self, group: SequenceGroup, pick: Pick) -> list[int]:
        """Append the pick to the group's active sequences and apply the stop rules. Returns the rows
        that go on (indices into the old `active_rows`, for the runner's `select`); `active_rows`
        becomes theirs."""
        keep = []
        for row, seq_index in enumerate(group.active_rows):
            seq = group.sequences[seq_index]
            self.append(seq, pick, row)
            self.check_stop(seq, group)
            if not seq.is_finished:
                keep.append(row)
                if seq.grammar is not None:  # its next mask follows the token (a finished one needs none)
                    seq.grammar.advance(seq.token_ids[-1])
        group.active_rows = [group.active_rows[r] for r in keep]
        return keep

    @staticmethod
    def append(seq: SequenceState, pick: Pick, row: int) -> None:
        seq.token_ids.append(int(pick.tokens[row]))
        seq.logprobs.append(float(pick.logprobs[row]))
        if pick.top_ids.shape[1]:
            seq.top_ids.append(pick.top_ids[row])
            seq.top_logprobs.append(pick.top_logprobs[row])
        if pick.columns or pick.processed_logprobs is not None or pick.constraint_logprobs is not None:
            log = seq.rows = seq.rows or RowLog()
            for name, values in pick.columns.items():
                log.add(name, values[row])
            if pick.processed_logprobs is not None:
                log.processed_logprobs.append(float(pick.processed_logprobs[row]))
                if pick.top_ids.shape[1]:
                    log.processed_top_logprobs.append(pick.processed_top_logprobs[row])
                    if pick.processed_top_ids is not None:
                        log.processed_top_ids.append(pick.processed_top_ids[row])
            if pick.constraint_logprobs is not None:
                log.constraint_logprobs.append(float(pick.constraint_logprobs[row]))

    @staticmethod
    def finish_prompt_only(group: SequenceGroup) -> None:
        """A request that generates nothing (max_tokens 0) ends with its prompt."""
        for seq in group.sequences:
            seq.finish_reason = FinishReason.LENGTH

    def check_stop(self, seq: SequenceState, group: SequenceGroup) -> None:
        """Add the sequence's new token to its text, and finish it where a stop rule says. As vLLM:
        `ignore_eos` turns the stop tokens off (stop strings still apply), and nothing but the length ends
        a choice within its first `min_tokens` tokens (its stop tokens are masked there, steering.py; a stop
        string counts from the next token on, where it ends in that token's text)."""
        params = group.params
        token = seq.token_ids[-1]
        before = seq.text.length
        may_stop = len(seq.token_ids) > params.min_tokens
        ends = token in params.stop_token_ids and not params.ignore_eos and may_stop
        # a special token writes its text only with skip_special_tokens false (by default every token the
        # tokenizer marks special writes none), and the stop token that ends the choice never does (vLLM's
        # detokenizer drops it)
        skip = params.skip_special_tokens
        seq.text.add(token, special_text=not skip and not ends, silent=skip and token in seq.text.table.skipped_ids)
        if ends:
            seq.finish_reason = FinishReason.STOP
        elif params.stop and may_stop and cut_at_stop(seq, params.stop, before):
            seq.finish_reason = FinishReason.STOP
        elif len(seq.token_ids) >= params.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        elif group.num_prompt_tokens + len(seq.token_ids) >= self.context_length:
            seq.finish_reason = FinishReason.LENGTH
        if seq.is_finished:
            seq.text.finish()


def cut_at_stop(seq: SequenceState, stops: list[str], before: int) -> bool:
    """End the text before the first stop string that the new token completed (`before`: the text's
    length before it); drop the tokens that start at or after the cut."""
    start = seq.text.offsets[0]  # where the generated text starts in the choice text
    text = seq.text.text
    window = max(0, before - start - max(len(s) for s in stops) + 1)
    hits = [p for p in (text.find(s, window) for s in stops) if p >= 0]
    if not hits:
        return False
    cut = min(hits)
    seq.text_end = cut
    seq.num_kept = sum(1 for off in seq.text.offsets if off < start + cut)
    return True
