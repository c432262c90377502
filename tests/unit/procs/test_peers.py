"""API processes' datagrams to each other (service/procs/peers.py): each message arrives whole, in order, on
the receiver's event loop; one to a sibling that is gone is lost with a line in the log, never an error."""

import asyncio
import logging

from service.procs.peers import UnixPeers, peer_path


def test_messages_reach_the_sibling_they_name_and_one_to_a_missing_sibling_is_logged(tmp_path, caplog):
    async def run():
        a, b = UnixPeers(str(tmp_path), 0, 3), UnixPeers(str(tmp_path), 1, 3)
        got = []
        b.listen(got.append)
        for i in range(200):
            a.send(1, b"x%d" % i + b"\0" * 300)
        with caplog.at_level(logging.WARNING):
            a.send(2, b"to nobody")  # process 2 is not running
        for _ in range(100):
            if len(got) == 200:
                break
            await asyncio.sleep(0.01)
        a.close(), b.close()
        return got

    got = asyncio.run(run())
    assert got == [b"x%d" % i + b"\0" * 300 for i in range(200)]
    assert "1 messages to API process 2 were lost" in caplog.text


def test_a_restarted_process_takes_its_socket_back(tmp_path):
    first = UnixPeers(str(tmp_path), 0, 1)
    first.close()  # (its socket file stays, as after a crash)
    again = UnixPeers(str(tmp_path), 0, 1)
    assert (tmp_path / "peer0.sock").exists() and peer_path(str(tmp_path), 0) == str(tmp_path / "peer0.sock")
    again.close()
