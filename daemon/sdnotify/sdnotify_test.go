package sdnotify

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/tandem-llm/tandem/daemon/sdnotify/sdnotifytest"
)

func TestNotifications(t *testing.T) {
	sock := sdnotifytest.Listen(t)
	tests := []struct {
		send func() error
		want string
	}{
		{Ready, "READY=1"},
		{func() error { return Status("loading layers 0-15\nfrom disk") }, "STATUS=loading layers 0-15 from disk"},
		{Stopping, "STOPPING=1"},
	}
	for _, tt := range tests {
		if err := tt.send(); err != nil {
			t.Fatal(err)
		}
		if got := sock.Next(t, time.Second); got != tt.want {
			t.Errorf("got %q, want %q", got, tt.want)
		}
	}
}

func TestOutsideSystemd(t *testing.T) {
	t.Setenv("NOTIFY_SOCKET", "")
	t.Setenv("WATCHDOG_USEC", "")
	for _, f := range []func() error{Ready, Stopping, func() error { return Status("x") }} {
		if err := f(); err != nil {
			t.Errorf("without NOTIFY_SOCKET: %v", err)
		}
	}
	stop, err := StartWatchdog(context.Background(), func() bool { return true }, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	stop()
	goleak.VerifyNone(t)
}

func TestNotifyError(t *testing.T) {
	t.Setenv("NOTIFY_SOCKET", filepath.Join(t.TempDir(), "nobody-listens"))
	if err := Ready(); err == nil || !strings.Contains(err.Error(), "sd_notify READY=1") {
		t.Errorf("Ready to a missing socket: %v", err)
	}
}

func TestWatchdog(t *testing.T) {
	sock := sdnotifytest.Listen(t)
	t.Setenv("WATCHDOG_USEC", "100000") // pings every 50 ms
	t.Setenv("WATCHDOG_PID", strconv.Itoa(os.Getpid()))
	var healthy atomic.Bool
	healthy.Store(true)
	stop, err := StartWatchdog(context.Background(), healthy.Load, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	for range 3 {
		if got := sock.Next(t, time.Second); got != "WATCHDOG=1" {
			t.Fatalf("while healthy: got %q, want WATCHDOG=1", got)
		}
	}
	healthy.Store(false)
	// At most one ping may have been in flight when health turned.
	sock.Next(t, 100*time.Millisecond)
	if got := sock.Next(t, 300*time.Millisecond); got != "" {
		t.Fatalf("while unhealthy: got %q, want no ping", got)
	}
	healthy.Store(true)
	if got := sock.Next(t, time.Second); got != "WATCHDOG=1" {
		t.Fatalf("healthy again: got %q, want WATCHDOG=1", got)
	}
	stop()
	stop() // idempotent
	sock.Next(t, 20*time.Millisecond)
	if got := sock.Next(t, 300*time.Millisecond); got != "" {
		t.Fatalf("after stop: got %q, want no ping", got)
	}
	goleak.VerifyNone(t)
}

func TestWatchdogContext(t *testing.T) {
	sock := sdnotifytest.Listen(t)
	t.Setenv("WATCHDOG_USEC", "100000")
	t.Setenv("WATCHDOG_PID", "")
	ctx, cancel := context.WithCancel(context.Background())
	stop, err := StartWatchdog(ctx, func() bool { return true }, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	if got := sock.Next(t, time.Second); got != "WATCHDOG=1" {
		t.Fatalf("got %q, want WATCHDOG=1", got)
	}
	cancel()
	stop() // returns once the goroutine has seen the cancellation
	goleak.VerifyNone(t)
}

func TestWatchdogNotOurs(t *testing.T) {
	tests := []struct {
		name, usec, pid string
		wantErr         bool
	}{
		{"disabled", "", "", false},
		{"another process", "100000", strconv.Itoa(os.Getpid() + 1), false},
		{"malformed", "soon", "", true},
		{"negative", "-5", "", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sock := sdnotifytest.Listen(t)
			t.Setenv("WATCHDOG_USEC", tt.usec)
			t.Setenv("WATCHDOG_PID", tt.pid)
			stop, err := StartWatchdog(context.Background(), func() bool { return true }, slog.Default())
			if tt.wantErr {
				if err == nil || !strings.HasPrefix(err.Error(), "watchdog: ") {
					t.Fatalf("err %v, want a watchdog error", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer stop()
			if got := sock.Next(t, 200*time.Millisecond); got != "" {
				t.Errorf("got %q, want no ping", got)
			}
			goleak.VerifyNone(t)
		})
	}
}
