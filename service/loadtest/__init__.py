"""The load test and the soak, commands of the installed CLI (`qwen3vl-encoder loadtest`, `... soak`).

    cli        the load test's flags and its run from start to exit status
    media      the images, videos and /encode payloads it sends
    client     one client: requests, retries, replays (a thread, or a process of its own)
    driver     the pre-flight check, the clients started and collected, live progress
    checks     replays from the store and verification against a float32 reference
    report     results, the summary table, the time series, the JSON report
    plot       the PNG plot (matplotlib)
    soak       the soak: the load test, store readers and the server's resources, then its checks
    server     the server a soak starts
    readers    threads reading the store while the soak runs
    resources  the server's memory and file descriptors, sampled

rich and matplotlib (the `loadtest` extra) are imported only where they are used: this package and
`qwen3vl-encoder --help` work without them.
"""
