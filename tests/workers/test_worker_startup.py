"""What a worker checks and claims when it starts, on the node it landed on.

Unit tests without Ray: the model check's one line (node and path), and cores claimed per node
through lock files (two workers on one node never share a core; a dead worker's cores free up).
"""

from __future__ import annotations

import os

import pytest

from tenantq.workers.host import ModelUnreadableError, check_model_readable, claim_cores, node_name


def test_unreadable_model_names_the_node_and_the_path(tmp_path) -> None:
    missing = tmp_path / "models" / "llama"
    with pytest.raises(ModelUnreadableError) as err:
        check_model_readable(str(missing))
    line = str(err.value)
    assert "\n" not in line
    assert f"node {node_name()} cannot read the model at {missing}" in line
    assert "shared model volume" in line


def test_model_folder_without_weights_is_unreadable(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelUnreadableError, match=r"no \*\.safetensors"):
        check_model_readable(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\0")
    check_model_readable(str(tmp_path))  # config and a weights file readable: passes


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_workers_on_one_node_claim_different_cores_until_one_exits(tmp_path) -> None:
    usable = sorted(os.sched_getaffinity(0))
    first, first_locks = claim_cores(1, tmp_path)
    second, second_locks = claim_cores(1, tmp_path)
    assert first == usable[:1] and second == usable[1:2]  # this node's cores, in order
    everything, none = claim_cores(len(usable), tmp_path)
    assert (everything, none) == ([], [])  # not enough free cores: unpinned, nothing held
    for fd in first_locks:  # the first worker exits: the kernel drops its lock
        os.close(fd)
    again, again_locks = claim_cores(1, tmp_path)
    assert again == first
    for fd in second_locks + again_locks:
        os.close(fd)
