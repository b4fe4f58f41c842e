// Package sdnotify tells systemd how tandemd is doing, through the
// notification socket of a Type=notify unit (the daemon package of
// github.com/coreos/go-systemd/v22): READY=1 once the stage is loaded and
// serving, STOPPING=1 when draining, a status line, and watchdog pings
// from a health-gated loop. Outside systemd (no NOTIFY_SOCKET) every call
// does nothing.
//
// The units themselves are in the repository's systemd/ directory; a test
// here checks them with systemd-analyze verify when it is installed.
//
// # Usage
//
//	stop, err := sdnotify.StartWatchdog(ctx, daemonIsResponsive, logger)
//	if err != nil { ... }
//	defer stop()
//	... load the stage, start serving ...
//	sdnotify.Ready()
//	<-ctx.Done()
//	sdnotify.Stopping()
//
// # Concurrency
//
// The functions are safe for concurrent use. StartWatchdog runs one
// goroutine, calling healthy from it; stop (or the context) ends it.
package sdnotify
