package sdnotify

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
)

// Ready tells systemd the service is up (READY=1): for tandemd, once its
// stage is loaded and its servers are serving.
func Ready() error { return notify(daemon.SdNotifyReady) }

// Stopping tells systemd the service is shutting down (STOPPING=1).
func Stopping() error { return notify(daemon.SdNotifyStopping) }

// Status sets the one-line status systemctl status shows (STATUS=...).
// Line breaks in s become spaces: a notification is one field per line.
func Status(s string) error {
	return notify("STATUS=" + strings.NewReplacer("\r\n", " ", "\n", " ", "\r", " ").Replace(s))
}

// notify sends state to systemd's notification socket; without
// NOTIFY_SOCKET (not run by systemd as Type=notify) it does nothing.
func notify(state string) error {
	if _, err := daemon.SdNotify(false, state); err != nil {
		return fmt.Errorf("sd_notify %s: %w", state, err)
	}
	return nil
}

// StartWatchdog pings systemd's watchdog (WATCHDOG=1) every half of the
// unit's WatchdogSec, but only while healthy returns true: a wedged daemon
// stops pinging and systemd restarts it. healthy should report that the
// daemon makes progress (its loops answer), not that the pipeline is ready,
// or a daemon waiting for its peers would be killed. Without a watchdog
// for this process (WATCHDOG_USEC unset, or WATCHDOG_PID another process)
// it starts nothing. A malformed WATCHDOG_USEC is an error.
//
// The pings stop when ctx is done or stop is called; stop waits for the
// pinging goroutine to end and may be called more than once. A failed
// ping is logged to log.
func StartWatchdog(ctx context.Context, healthy func() bool, log *slog.Logger) (stop func(), err error) {
	interval, err := daemon.SdWatchdogEnabled(false)
	if err != nil {
		return nil, fmt.Errorf("watchdog: %w", err)
	}
	if interval == 0 {
		return func() {}, nil
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		ping(ctx, interval/2, healthy, log)
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			cancel()
			<-done
		})
	}, nil
}

// ping sends WATCHDOG=1 at once and then every period while healthy.
func ping(ctx context.Context, period time.Duration, healthy func() bool, log *slog.Logger) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		if healthy() {
			if err := notify(daemon.SdNotifyWatchdog); err != nil {
				log.Warn("watchdog ping failed", "err", err)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
