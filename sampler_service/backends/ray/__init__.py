"""Engine replicas as Ray actors (`--replicas N`): the actor around an unchanged backend
(`replica.py`), its waves in batched calls (`channel.py`), each replica one member of the
fleet (`member.py`), and the Ray session and the fleet around them (`transport.py`)."""
