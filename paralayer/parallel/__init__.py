"""One axis per file or package; applied in the order pipeline → tensor → context → expert → data.

An axis with several files is a package (pipeline/, tensor/, context/); expert.py, data.py (with
grad_sync.py and grad_scaling.py) and mesh.py are one file each. Shared by the axes: local_shard.py,
tied_embeddings.py (the embedding and head copies across the pipeline), and the straggler watch's
comm_trace.py and collective_timing.py."""
