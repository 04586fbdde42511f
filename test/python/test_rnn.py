"""RNNs (LSTM, GRU, RNN and their cells, padded and packed): on the CPU backing device lazymem makes the
CPU composite's decisions (oneDNN for LSTM, precomputed input projections, unfused cells), so outputs,
hidden states, input gradients, parameter gradients and trained parameters are bitwise eager CPU's."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from conftest import OpTrace, assert_bitwise, to_lazy
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import torch_lazymem

pytestmark = [
    pytest.mark.skipif(torch_lazymem.backing_device().type != "cpu",
                       reason="bitwise comparison with eager CPU needs the CPU backing device"),
    pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN"),
]


def flat(o):
    if isinstance(o, torch.Tensor):
        return [o]
    if isinstance(o, nn.utils.rnn.PackedSequence):
        return [o.data]
    return [t for e in o for t in flat(e)]


def run_both(module, x, hidden=None, lengths=None, seed=0):
    """Forward and backward on eager CPU and on lazymem from the same weights, inputs and RNG state."""
    module.zero_grad(set_to_none=True)
    lazy_module = copy.deepcopy(module).to("lazymem")
    results = []
    for dev, m in (("cpu", module), ("lazymem", lazy_module)):
        xi = x.clone().to(dev).requires_grad_()
        hi = hidden if dev == "cpu" else to_lazy(hidden)
        hi = None if hi is None else (tuple(t.detach().requires_grad_() for t in hi) if isinstance(hi, tuple)
                                      else hi.detach().requires_grad_())
        inp = xi if lengths is None else pack_padded_sequence(xi, lengths, module.batch_first, enforce_sorted=False)
        torch.manual_seed(seed)
        out = m(inp) if hi is None else m(inp, hi)
        outs = flat(out)
        # A different weight per output, so every output's gradient path counts.
        sum(t.sum() * (i + 1) for i, t in enumerate(outs)).backward()
        grads = [xi.grad] + ([] if hi is None else [t.grad for t in flat(hi)])
        results.append((outs, grads, [p.grad for p in m.parameters()]))
    return results


def assert_same(results):
    (outs, grads, pgrads), (louts, lgrads, lpgrads) = results
    assert len(outs) == len(louts)
    for lazy, expected in zip(louts + lgrads + lpgrads, outs + grads + pgrads):
        assert_bitwise(lazy, expected)


MODULES = {
    "lstm": lambda: nn.LSTM(5, 6),
    "lstm_2layer_bidir_batch_first": lambda: nn.LSTM(5, 6, 2, batch_first=True, bidirectional=True),
    "lstm_nobias_dropout": lambda: nn.LSTM(5, 6, 3, bias=False, dropout=0.4),
    "lstm_proj_bidir_dropout": lambda: nn.LSTM(5, 6, 2, proj_size=3, bidirectional=True, dropout=0.3),
    "gru": lambda: nn.GRU(5, 6),
    "gru_2layer_bidir_batch_first_dropout": lambda: nn.GRU(5, 6, 2, batch_first=True, bidirectional=True, dropout=0.5),
    "gru_nobias": lambda: nn.GRU(5, 6, 2, bias=False),
    "rnn_tanh_bidir": lambda: nn.RNN(5, 6, 2, bidirectional=True),
    "rnn_relu_batch_first_nobias_dropout": lambda: nn.RNN(5, 6, 3, nonlinearity="relu", batch_first=True, bias=False,
                                                          dropout=0.2),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_full_sequence(name):
    torch.manual_seed(0)
    m = MODULES[name]()
    shape = (3, 7, 5) if m.batch_first else (7, 3, 5)
    assert_same(run_both(m, torch.randn(*shape)))


@pytest.mark.parametrize("name", ["lstm_2layer_bidir_batch_first", "gru_nobias", "rnn_tanh_bidir"])
def test_given_initial_state_gets_gradients(name):
    torch.manual_seed(1)
    m = MODULES[name]()
    layers = m.num_layers * (2 if m.bidirectional else 1)
    x = torch.randn(4, 3, 5)
    h0 = torch.randn(layers, 4 if m.batch_first else 3, 6)
    hidden = (h0, torch.randn_like(h0)) if isinstance(m, nn.LSTM) else h0
    assert_same(run_both(m, x, hidden))


def test_to_lazy_keeps_container_types():
    """conftest.to_lazy (used for hidden states here and for batches by training.py and splitting.py)
    moves every tensor of a pytree to lazymem and keeps its containers' types, namedtuples included."""
    State = collections.namedtuple("State", "h c")
    h, c, ids, mask = torch.randn(2, 3), torch.randn(2, 3), torch.arange(4), torch.ones(2, dtype=torch.bool)
    lazy = to_lazy({"state": State(h, c), "ids": [ids, (mask, 7)], "none": None, "name": "x"})
    assert type(lazy) is dict and list(lazy) == ["state", "ids", "none", "name"]
    assert type(lazy["state"]) is State and type(lazy["ids"]) is list and type(lazy["ids"][1]) is tuple
    assert lazy["ids"][1][1] == 7 and lazy["none"] is None and lazy["name"] == "x"
    for got, want in ((lazy["state"].h, h), (lazy["state"].c, c), (lazy["ids"][0], ids), (lazy["ids"][1][0], mask)):
        assert_bitwise(got, want)
    assert type(to_lazy(State(h, c))) is State and to_lazy(None) is None
    assert_bitwise(to_lazy(h), h)


@pytest.mark.parametrize("name", ["lstm", "gru", "rnn_tanh_bidir"])
def test_unbatched_input(name):
    torch.manual_seed(2)
    assert_same(run_both(MODULES[name](), torch.randn(6, 5)))


@pytest.mark.parametrize("name", ["lstm_2layer_bidir_batch_first", "lstm_proj_bidir_dropout",
                                  "gru_2layer_bidir_batch_first_dropout", "rnn_relu_batch_first_nobias_dropout"])
def test_packed_sequence(name):
    torch.manual_seed(3)
    m = MODULES[name]()
    x = torch.randn(4, 6, 5) if m.batch_first else torch.randn(6, 4, 5)
    lengths = torch.tensor([6, 2, 5, 1])  # unsorted: the sorting permutation runs on lazymem too
    assert_same(run_both(m, x, lengths=lengths))
    h0 = torch.randn(m.num_layers * (2 if m.bidirectional else 1), 4, m.proj_size or 6)
    hidden = (h0, torch.randn(h0.shape[0], 4, 6)) if isinstance(m, nn.LSTM) else h0
    assert_same(run_both(m, x, hidden, lengths=lengths))


@pytest.mark.parametrize("cell", [nn.LSTMCell, nn.GRUCell, nn.RNNCell])
@pytest.mark.parametrize("bias", [True, False])
def test_cells(cell, bias):
    torch.manual_seed(4)
    m = cell(5, 6, bias=bias)
    assert_same(run_both(m, torch.randn(3, 5)))
    assert_same(run_both(m, torch.randn(5)))  # unbatched


def test_cell_unrolled_over_a_sequence():
    torch.manual_seed(5)
    cell = nn.LSTMCell(5, 6)
    lazy_cell = copy.deepcopy(cell).to("lazymem")
    xs = torch.randn(4, 2, 5)
    h = c = torch.zeros(2, 6)
    lh = lc = torch.zeros(2, 6, device="lazymem")
    # Step through views of one lazymem tensor, as eager steps through views of xs: a GEMM's rounding
    # can depend on its operands' alignment, so a fresh copy of each step could differ by an ulp.
    for x, lx in zip(xs, xs.to("lazymem")):
        h, c = cell(x, (h, c))
        lh, lc = lazy_cell(lx, (lh, lc))
    (h.sum() + c.sum()).backward()
    (lh.sum() + lc.sum()).backward()
    assert_bitwise(lh, h)
    assert_bitwise(lc, c)
    for p, lp in zip(cell.parameters(), lazy_cell.parameters()):
        assert_bitwise(lp.grad, p.grad)


def test_cell_errors_match_eager():
    cell = nn.GRUCell(5, 6).to("lazymem")
    with pytest.raises(RuntimeError, match="input has inconsistent input_size: got 4 expected 5"):
        cell(torch.randn(3, 4, device="lazymem"))
    with pytest.raises(RuntimeError, match="Input batch size 3 doesn't match hidden0 batch size 2"):
        torch.gru_cell(torch.randn(3, 5, device="lazymem"), torch.randn(2, 6, device="lazymem"),
                       cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)


def test_inference_no_grad_and_inference_mode():
    torch.manual_seed(6)
    m = nn.LSTM(5, 6, 2, bidirectional=True).eval()
    lm = copy.deepcopy(m).to("lazymem")
    x = torch.randn(7, 3, 5)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            ref = m(x)
            got = lm(x.to("lazymem"))
        for a, b in zip(flat(got), flat(ref)):
            assert_bitwise(a, b)
    g = nn.GRU(5, 6, batch_first=True)
    lg = copy.deepcopy(g).to("lazymem")
    with torch.inference_mode():
        assert_bitwise(lg(x.to("lazymem"))[0], g(x)[0])


def test_eval_mode_skips_dropout():
    torch.manual_seed(7)
    m = nn.GRU(5, 6, 3, dropout=0.5).eval()
    assert_same(run_both(m, torch.randn(4, 2, 5)))


def test_lstm_workspace_survives_a_no_grad_sync():
    # The oneDNN forward keeps a training workspace for the backward only when grad mode is on at
    # record time; materializing under no_grad must not change what was recorded.
    torch.manual_seed(8)
    m = nn.LSTM(5, 6, 2)
    lm = copy.deepcopy(m).to("lazymem")
    x = torch.randn(7, 3, 5)
    out = m(x)[0]
    lout = lm(x.to("lazymem"))[0]
    with torch.no_grad():
        assert_bitwise(lout, out)
    out.sum().backward()
    lout.sum().backward()
    for p, lp in zip(m.parameters(), lm.parameters()):
        assert_bitwise(lp.grad, p.grad)


def test_lstm_without_mkldnn_and_in_double():
    torch.manual_seed(9)
    with torch.backends.mkldnn.flags(enabled=False):
        assert_same(run_both(nn.LSTM(5, 6, 2, bidirectional=True), torch.randn(4, 3, 5)))
    assert_same(run_both(nn.LSTM(5, 6, 2).double(), torch.randn(4, 3, 5, dtype=torch.float64)))


def test_lstm_records_eager_cpu_ops():
    torch.manual_seed(10)
    m = nn.LSTM(5, 6, 2, dropout=0.3)
    lm = copy.deepcopy(m).to("lazymem")
    seqs = []
    for mod, dev in ((m, "cpu"), (lm, "lazymem")):
        x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(0)).to(dev).requires_grad_()
        with OpTrace() as ops:
            mod(x)[0].sum().backward()
        seqs.append(ops.ops)
    assert seqs[0] == seqs[1]
    assert "aten.mkldnn_rnn_layer.default" in seqs[1] and "aten.mkldnn_rnn_layer_backward.default" in seqs[1]


class Tagger(nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.emb = nn.Embedding(20, 5)
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 4)

    def forward(self, tokens):
        return self.head(self.rnn(self.emb(tokens))[0])


@pytest.mark.parametrize("rnn", [lambda: nn.LSTM(5, 8, 2, batch_first=True, dropout=0.2),
                                 lambda: nn.GRU(5, 8, 2, batch_first=True, bidirectional=True, dropout=0.2)],
                         ids=["lstm", "gru"])
def test_training_steps_match_eager(rnn):
    torch.manual_seed(11)
    model = Tagger(rnn())
    lazy_model = copy.deepcopy(model).to("lazymem")
    opts = [torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9) for mod in (model, lazy_model)]
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        tokens = torch.randint(0, 20, (4, 9), generator=gen)
        target = torch.randint(0, 4, (4, 9), generator=gen)
        losses = []
        for mod, opt, dev in ((model, opts[0], "cpu"), (lazy_model, opts[1], "lazymem")):
            torch.manual_seed(100 + step)  # the same dropout masks
            opt.zero_grad()
            logits = mod(tokens.to(dev))
            loss = nn.functional.cross_entropy(logits.reshape(-1, 4), target.to(dev).reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss)
        assert_bitwise(losses[1], losses[0])
    for p, lp in zip(model.parameters(), lazy_model.parameters()):
        assert_bitwise(lp, p)
