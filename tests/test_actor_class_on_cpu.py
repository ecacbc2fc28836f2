"""``sat.actor_class``: the actor worker class the recipe selects, AsyncSATActor or a subclass.

Guards the validation before Ray starts (a bad path or a class that is not an AsyncSATActor is an
error naming the key) and the composition over verl's worker class (the subclass's methods run
first, verl's dispatch attributes are kept).
"""

from __future__ import annotations

import pytest

from verl_sat.trainer.actor import AsyncSATActor, actor_class_of, sat_worker_class
from verl_sat.trainer.recipe import SATRecipeConfig


class MyActor(AsyncSATActor):
    """A user's extension: what a subclass of AsyncSATActor looks like."""


def test_the_default_and_a_subclass_resolve():
    assert actor_class_of(None) is AsyncSATActor
    assert actor_class_of(SATRecipeConfig().actor_class) is AsyncSATActor
    assert actor_class_of(f"{__name__}.MyActor") is MyActor
    assert SATRecipeConfig.from_node({"actor_class": f"{__name__}.MyActor"}).actor_class.endswith("MyActor")


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module.Actor", r"sat.actor_class='no_such_module.Actor' cannot be imported"),
        (f"{__name__}.Nothing", r"cannot be imported"),
        ("MyActor", r"sat.actor_class='MyActor' cannot be imported"),  # not a dotted path
        ("collections.OrderedDict", r"is not a subclass of verl_sat.trainer.actor.AsyncSATActor"),
    ],
)
def test_a_bad_actor_class_is_an_error_naming_the_key(path, message):
    with pytest.raises(ValueError, match=message):
        SATRecipeConfig.from_node({"actor_class": path})


def test_the_worker_class_puts_the_actor_class_over_verls_worker():
    import ray
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers.engine_workers import ActorRolloutRefWorker

    remote = sat_worker_class(ray.remote(ActorRolloutRefWorker), MyActor)
    cls = remote.__ray_actor_class__
    assert cls.__mro__[1:4] == (MyActor, AsyncSATActor, ActorRolloutRefWorker)
    assert cls.__name__ == "SATActorRolloutRefWorker"
    assert getattr(cls.init_model, MAGIC_ATTR) == getattr(ActorRolloutRefWorker.init_model, MAGIC_ATTR)
    assert hasattr(cls.sat_scale_lr, MAGIC_ATTR)
