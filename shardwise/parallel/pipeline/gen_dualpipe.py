"""Generator of DualPipeV, with its messages placed as DeepSeek's implementation issues them.

DualPipe is the bidirectional schedule of the DeepSeek-V3 technical report (arXiv 2412.19437);
DualPipeV is its "cut-in-half" V form (Sea AI Lab), published in github.com/deepseek-ai/DualPipe
(``dualpipe/dualpipev.py``). 2p stages in a V: rank r holds stage a = r (phase 0, going down)
and stage b = 2p-1-r (phase 1, coming back up); the loss is on rank 0.

Each rank runs eight phases; ``F&B`` below is a forward of one stage and a full backward of the
other, issued together (DualPipe overlaps their computation with each other's communication;
our actions run them one after the other, F then B):

    1. 2(p-r-1) x  F a                 5. p-r-1 x      B b, F&B (b, a)
    2. r+1 x       F a, F b            6. r+1 x        backward b, backward a (the second half
    3. p-r-1 x     I b, W, F b                         split: I now, its W queued)
    4. m-2p+r+1 x  F&B (a, b), F&B (b, a)   7. p-r-1 x  W, I a
                                            8. r+1 x    W

W always takes the oldest queued weight gradient. Messages are placed exactly where
DualPipeV posts them (a receive just before the batch that waits for it, a send just after its
compute), because the batches decide when data leaves a rank: with free messages and
F = I = W, B = 2F, F&B = F + B, this reproduces the README's bubble (PP/2-1)(F&B + B - 3W)
per rank (PP = 2p stages). Needs m >= 2p micro-batches.
"""

from __future__ import annotations

from collections import deque

from shardwise.parallel.pipeline.actions import Action, Kind

__all__ = ["dualpipev"]


class _Rank:
    """One rank's list being written in DualPipeV's order (messages included)."""

    def __init__(self, rank: int, pp: int) -> None:
        self.r, self.pp = rank, pp
        self.stage = (rank, 2 * pp - 1 - rank)
        self.next: dict[tuple[int, str], int] = {}
        self.weights: deque[tuple[int, int]] = deque()
        self.actions: list[Action] = []

    def _emit(self, phase: int, kind: Kind, counter: str | None = None) -> None:
        key = (phase, counter or kind.value)
        mb = self.next.get(key, 0)
        self.next[key] = mb + 1
        self.actions.append(Action(self.stage[phase], kind, mb))

    # Which messages exist: stage 0's input is the data, stage 2p-1 ends in the loss, and the
    # bottom of the V (stages p-1 and p, both on rank p-1) hands over locally.
    def _no_input(self, phase: int) -> bool:
        return (self.r == 0 and phase == 0) or (self.r == self.pp - 1 and phase == 1)

    def _no_output(self, phase: int) -> bool:
        return (self.r == 0 and phase == 1) or (self.r == self.pp - 1 and phase == 0)

    def recv_f(self, phase: int) -> None:
        if not self._no_input(phase):
            self._emit(phase, Kind.RECV_F)

    def send_f(self, phase: int) -> None:
        if not self._no_output(phase):
            self._emit(phase, Kind.SEND_F)

    def recv_b(self, phase: int) -> None:
        if not self._no_output(phase):
            self._emit(phase, Kind.RECV_B)

    def send_b(self, phase: int) -> None:
        if not self._no_input(phase):
            self._emit(phase, Kind.SEND_B)

    def forward(self, phase: int, recv: bool = True, send: bool = True) -> None:
        if recv:
            self.recv_f(phase)
        self._emit(phase, Kind.F)
        if send:
            self.send_f(phase)

    def backward(self, phase: int, split: bool = False, send: bool = True) -> None:
        self.recv_b(phase)
        self._compute_backward(phase, split)
        if send:
            self.send_b(phase)

    def _compute_backward(self, phase: int, split: bool) -> None:
        mb = self.next.get((phase, "back"), 0)
        self._emit(phase, Kind.I if split else Kind.B, counter="back")
        if split:
            self.weights.append((self.stage[phase], mb))

    def forward_backward(self, f_phase: int, b_phase: int, recv_f: bool = True) -> None:
        if recv_f:
            self.recv_f(f_phase)
        self.recv_b(b_phase)
        self._emit(f_phase, Kind.F)
        self._compute_backward(b_phase, split=False)
        self.send_f(f_phase)
        self.send_b(b_phase)

    def weight(self) -> None:
        stage, mb = self.weights.popleft()
        self.actions.append(Action(stage, Kind.W, mb))


def dualpipev(pp: int, microbatches: int, virtual: int) -> list[list[Action]]:
    """DualPipeV's per-rank lists, messages included (``virtual`` must be 2, m >= 2 pp)."""
    assert virtual == 2 and microbatches >= 2 * pp
    return [_one_rank(r, pp, microbatches).actions for r in range(pp)]


def _one_rank(r: int, pp: int, m: int) -> _Rank:
    rk = _Rank(r, pp)
    last = r == pp - 1
    for _ in range(2 * (pp - r - 1)):                       # 1: F a
        rk.forward(0)
    rk.recv_f(0)                                            # 2: F a, F b
    for i in range(r + 1):
        rk.forward(0, recv=False, send=False)
        rk.recv_f(0)
        rk.forward(1, send=not last or i < r)
        rk.send_f(0)
    for _ in range(pp - r - 1):                             # 3: I b, W, F b
        rk.backward(1, split=True)
        rk.recv_f(1)
        rk.weight()
        rk.forward(1, recv=False)
    for i in range(m - 2 * pp + r + 1):                     # 4: F&B (a, b), F&B (b, a)
        if i == 0 and last:
            # The last rank sends its held-back F b only now and does not pair F a with B b.
            rk.forward(0, recv=False, send=False)
            rk.send_f(1)
            rk.backward(1, send=False)
            rk.send_f(0)
            rk.send_b(1)
        else:
            rk.forward_backward(0, 1, recv_f=i > 0)
        rk.forward_backward(1, 0)
    for _ in range(pp - r - 1):                             # 5: B b, F&B (b, a)
        rk.backward(1)
        rk.forward_backward(1, 0)
    split = False                                           # 6: backward b, backward a
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        rk.backward(1, split=split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        rk.backward(0, split=split)
    for _ in range(pp - r - 1):                             # 7: W, I a
        rk.weight()
        rk.backward(0, split=True)
    for _ in range(r + 1):                                  # 8: W
        rk.weight()
    return rk
