"""The engine process's answers to claims (service/enginep.py): admission before decode by images and
by the tokens each image's header declares, places given back on cancel and on disconnect."""

from service.batcher import BatchLimits, Batcher
from service.enginep import EngineHost


class _EmptyStore:
    def lookup(self, key):
        return None


def test_claims_admit_by_images_and_header_tokens_and_give_places_back():
    batcher = Batcher(BatchLimits(max_batch_tokens=100, max_batch_images=8, max_wait_s=0.01, max_queue_images=3,
                                  max_queue_tokens=500))
    host = EngineHost(settings=None, model=None, store=_EmptyStore(), batcher=batcher, engine=None, metrics=None)
    sent: list = []
    conn = host.connected(sent.append)
    sha = "0" * 64

    def claim(rid: int, key: str, tokens: int) -> list:
        host.handle(conn, ["claim", rid, key, sha, tokens])
        return sent[-1]

    assert claim(1, "a", 400) == ["decode", 1]
    refused = claim(2, "b", 200)  # 400 + 200 tokens > 500, before anything is decoded
    assert refused[:3] == ["error", 2, "overloaded"] and "limit 500 tokens" in refused[3] and refused[4] >= 1
    assert claim(3, "c", 50) == ["decode", 3] and claim(4, "d", 20) == ["decode", 4]
    assert claim(5, "e", 1)[:3] == ["error", 5, "overloaded"]  # 3 images being decoded: full by count
    assert batcher.reserved() == 3
    host.handle(conn, ["cancel", 1])  # the API process gave up on image a (its decode failed, say)
    assert batcher.reserved() == 2 and claim(6, "b", 200) == ["decode", 6]
    host.disconnected(conn)  # the API process died: its places go back
    assert batcher.reserved() == 0
