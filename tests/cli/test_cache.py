from freetoken.cli import cache


def test_the_policy_column_names_adaptives_placement_and_its_sizes_apart():
    row = {"policy": "adaptive", "placement": "split", "placement_by_batch": {"4": "device"}}
    assert cache._policy(row) == "adaptive (split; 4 streams: device)"
    row["placement_by_batch"] = {"4": "device", "1": "cache"}  # through JSON: string keys
    assert cache._policy(row) == "adaptive (split; 1 stream: cache; 4 streams: device)"
    assert cache._policy({"policy": "adaptive", "placement": "layers"}) == "adaptive (layers)"
    assert cache._policy({"policy": "lru-pcie"}) == "lru-pcie"
