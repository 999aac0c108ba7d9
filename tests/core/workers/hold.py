import ddl

ddl.init()  # rank 0 of 2 with no peer: must give up after DDL_INIT_TIMEOUT
