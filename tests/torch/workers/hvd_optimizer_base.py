"""The DistributedOptimizer as a torch.optim.Optimizer: step hooks, state-dict hooks, an LR
scheduler, state_dict()/load_state_dict() and zero_grad on the wrapper, for the plain and
the Adasum optimizer; wrapping an optimizer that has state already leaves it as it was.
Prints one JSON line."""

import json
import sys
import warnings

import torch

import ddl
import ddl.torch as hvd

hvd.init()
R = hvd.rank()
LR, STEPS = 0.1, 3


def batch(step):
    g = torch.Generator().manual_seed(10 * step + R)
    return torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)


def train(op):
    """STEPS steps under StepLR with every kind of hook on the wrapper; what they saw."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2)
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), op=op)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kw: seen.append(("step_pre", o is opt)))
    opt.register_step_post_hook(lambda o, args, kw: seen.append(("step_post", o is opt)))
    opt.register_state_dict_pre_hook(lambda o: seen.append(("sd_pre", o is opt)))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": o is opt})
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(("load_pre", "tag" in sd)))
    opt.register_load_state_dict_post_hook(lambda o: seen.append(("load_post", o is opt)))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
    steps_seen = [s for s in seen if s[0].startswith("step")]
    out = {
        "steps": steps_seen == [("step_pre", True), ("step_post", True)] * STEPS,
        "lr": [opt.param_groups[0]["lr"], inner.param_groups[0]["lr"]],
        "shared": opt.param_groups is inner.param_groups and opt.state is inner.state,
        "scheduler_warned": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)],
        "weights": [v.tolist() for v in model.state_dict().values()],
    }
    sd = opt.state_dict()
    out["sd_hooks"] = seen[-1] == ("sd_pre", True) and sd.get("tag") is True
    # into a fresh model's wrapper: the state comes back, the hooks see it, state stays shared
    torch.manual_seed(1)
    model2 = torch.nn.Linear(5, 2)
    inner2 = torch.optim.SGD(model2.parameters(), lr=1.0, momentum=0.9)
    opt2 = hvd.DistributedOptimizer(inner2, named_parameters=model2.named_parameters(), op=op)
    calls = []
    opt2.register_load_state_dict_pre_hook(lambda o, d: calls.append("pre") or
                                           {k: v for k, v in d.items() if k != "tag"})
    handle = opt2.register_load_state_dict_post_hook(lambda o: calls.append("post"))
    opt2.load_state_dict(sd)
    handle.remove()
    opt2.load_state_dict(sd)
    out["load_hooks"] = calls == ["pre", "post", "pre"]
    out["loaded_lr"] = opt2.param_groups[0]["lr"]
    out["loaded_state"] = opt2.state is inner2.state and all(
        torch.equal(inner.state[p]["momentum_buffer"], inner2.state[q]["momentum_buffer"])
        for p, q in zip(model.parameters(), model2.parameters()))
    # zero_grad on the wrapper: refused while gradients are in flight (plain optimizer:
    # hooks launched the buckets), then clears the wrapped optimizer's gradients
    x, y = batch(STEPS)
    torch.nn.functional.mse_loss(model(x), y).backward()
    try:
        opt.zero_grad()
        out["zero_grad_in_flight"] = "allowed"
    except ddl.DDLError:
        out["zero_grad_in_flight"] = "refused"
        opt.synchronize()
    opt.zero_grad()
    out["zero_grad"] = all(p.grad is None for p in model.parameters())
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
        out["add_group"] = "added"
    except NotImplementedError:
        out["add_group"] = "refused"
    out["isinstance"] = isinstance(opt, torch.optim.Optimizer)
    return out


def wrap_keeps_state():
    """Wrapping an optimizer that has state (after a step) changes none of its objects."""
    model = torch.nn.Linear(3, 1)
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 3)).sum().backward()
    inner.step()
    before = (inner.state, inner.param_groups, inner.param_groups[0],
              inner.param_groups[0]["params"], inner.defaults, len(inner.state))
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    after = (inner.state, inner.param_groups, inner.param_groups[0],
             inner.param_groups[0]["params"], inner.defaults, len(inner.state))
    return (all(a is b for a, b in zip(before[:5], after[:5])) and before[5] == after[5] == 2
            and len(opt.param_groups) == 1)


print(json.dumps({"average": train(hvd.Average), "adasum": train(hvd.Adasum),
                  "adasum_type": type(hvd.DistributedOptimizer(
                      torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1),
                      op=hvd.Adasum)).__name__,
                  "keeps_state": wrap_keeps_state()}))
sys.stdout.flush()
