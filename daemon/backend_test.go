package daemon
