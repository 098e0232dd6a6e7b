"""The Triton kernels as torch.library custom ops: torch.compile keeps each as one opaque op in
the graph (fullgraph=True: no break), traced by its fake implementation, with the eager values."""

import pytest
import torch

pytest.importorskip("triton")

from lightning_ptdp.triton_kernels import bias_gelu, flash_attention  # noqa: E402
from lightning_ptdp.triton_kernels.reference import attention_reference, bias_gelu_reference  # noqa: E402

# fp32 against the fp64 reference, as test_attention.py / test_bias_gelu.py measure the kernels
# themselves: the compiled graph launches the same kernels, so the same budget holds.
TOL = dict(atol=1e-4, rtol=1e-4)


def _attention_then_bias_gelu(q, k, v, bias, attention, activation):
    out = attention(q, k, v, True)  # (B, H, S, D)
    return activation(out.transpose(1, 2).flatten(2), bias)  # (B, S, H*D)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_kernels_compile_in_one_graph_with_their_eager_values(device, backend):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 16, generator=gen).to(device) for _ in range(3))
    bias = torch.randn(32, generator=gen).to(device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    compiled = torch.compile(_attention_then_bias_gelu, backend=backend, fullgraph=True)
    out = compiled(*leaves, lambda q, k, v, c: flash_attention(q, k, v, causal=c), bias_gelu)
    grads = torch.autograd.grad(out.sum(), leaves)

    refs = [t.double().requires_grad_() for t in (q, k, v, bias)]
    expected = _attention_then_bias_gelu(
        *refs, lambda q, k, v, c: attention_reference(q, k, v, causal=c), bias_gelu_reference
    )
    expected_grads = torch.autograd.grad(expected.sum(), refs)
    torch.testing.assert_close(out.double(), expected, **TOL)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.double(), want, **TOL)


def test_the_compiled_graph_holds_the_kernels_as_ops(device):
    torch._dynamo.reset()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(4, 32, device=device)
    bias = torch.randn(32, device=device)
    torch.compile(lambda x, b: bias_gelu(x, b) * 2, backend=keep, fullgraph=True)(x, bias)
    (graph,) = graphs
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert "lightning_ptdp.bias_gelu_forward.default" in targets, targets
