"""A rank leaves while its peers wait for it in an allreduce; what are they told?

argv[1]: "raise" (an uncaught ValueError), "shutdown" (the program's own ddl.shutdown(),
then a pause), "end" (its script ends without an error). argv[2] "catch": the peers print
one JSON line with the error they caught; "uncaught": they let it end them (each then
writes its failure record where DDL_ERROR_FILE says).
"""

import json
import sys
import time

import numpy as np

import ddl

how, peers = sys.argv[1], sys.argv[2]
ddl.init()
R, N = ddl.rank(), ddl.size()
victim = N - 1
x = np.ones(4, np.float32)
ddl.allreduce(x)
if victim == R:
    if how == "raise":
        raise ValueError("boom")
    if how == "shutdown":
        ddl.shutdown()
        time.sleep(2)
    sys.exit(0)
if peers == "uncaught":
    ddl.allreduce(x)
try:
    ddl.allreduce(x)
    print(json.dumps(dict(rank=R, kind=None)), flush=True)
except ddl.DDLError as exc:
    print(json.dumps(dict(rank=R, kind=type(exc).__name__, msg=str(exc))), flush=True)
