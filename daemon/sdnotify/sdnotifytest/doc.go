// Package sdnotifytest stands in for systemd in tests of code that sends
// sd_notify messages: a unixgram socket that NOTIFY_SOCKET names for the
// duration of a test, and readers of what arrives on it.
//
// # Usage
//
//	s := sdnotifytest.Listen(t)   // sets NOTIFY_SOCKET for t
//	... start what notifies ...
//	if got := s.Next(t, time.Second); got != "READY=1" { ... }
//	lines := s.Until(t, 5*time.Second, "STOPPING=1")
//
// # Concurrency
//
// Listen sets an environment variable, so its test cannot run in parallel
// with others. A Socket is read from one goroutine at a time.
package sdnotifytest
