import pytest

from promptcache.blocks.free_queue import FreeNode, FreeQueue
from promptcache.errors import InvariantError


class Node(FreeNode):
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


def names(q: FreeQueue[Node]) -> list[str]:
    return [n.name for n in q]


def test_append_popleft_fifo_and_length():
    q: FreeQueue[Node] = FreeQueue()
    a, b, c = Node("a"), Node("b"), Node("c")
    assert len(q) == 0 and not q and q.peekleft() is None
    for n in (a, b, c):
        q.append(n)
    assert names(q) == ["a", "b", "c"] and len(q) == 3
    q.check()
    assert q.popleft() is a
    assert names(q) == ["b", "c"] and len(q) == 2
    assert a.prev_free is None and a.next_free is None and not a.in_free_queue
    q.check()


def test_remove_middle_head_tail_and_reappend():
    q: FreeQueue[Node] = FreeQueue()
    nodes = [Node(str(i)) for i in range(5)]
    for n in nodes:
        q.append(n)
    q.remove(nodes[2])
    assert names(q) == ["0", "1", "3", "4"]
    q.remove(nodes[0])
    q.remove(nodes[4])
    assert names(q) == ["1", "3"]
    q.check()
    q.append(nodes[0])
    q.appendleft(nodes[4])
    assert names(q) == ["4", "1", "3", "0"] and len(q) == 4
    q.check()
    assert [q.popleft().name for _ in range(4)] == ["4", "1", "3", "0"]
    assert len(q) == 0
    q.check()
    with pytest.raises(IndexError):
        q.popleft()


def test_misuse_raises_invariant_error():
    q: FreeQueue[Node] = FreeQueue()
    a = Node("a")
    with pytest.raises(InvariantError):
        q.remove(a)
    q.append(a)
    with pytest.raises(InvariantError):
        q.append(a)
    with pytest.raises(InvariantError):
        q.appendleft(a)


def test_check_detects_broken_links():
    q: FreeQueue[Node] = FreeQueue()
    a, b, c = Node("a"), Node("b"), Node("c")
    for n in (a, b, c):
        q.append(n)
    b.prev_free = c  # corrupt a back link
    with pytest.raises(InvariantError, match="wrong prev link"):
        q.check()
    b.prev_free = a
    q.check()
    q._len = 2  # corrupt the length
    with pytest.raises(InvariantError):
        q.check()
    q._len = 3
    b.next_free = None  # broken forward chain
    with pytest.raises(InvariantError, match="None link"):
        q.check()


def test_iteration_survives_removal_of_current_node():
    q: FreeQueue[Node] = FreeQueue()
    nodes = [Node(str(i)) for i in range(4)]
    for n in nodes:
        q.append(n)
    seen = []
    for n in q:
        seen.append(n.name)
        q.remove(n)
    assert seen == ["0", "1", "2", "3"] and len(q) == 0
    q.check()
