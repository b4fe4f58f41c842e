// Package apierr classifies the daemon's domain errors and maps them to
// the codes clients see: the one place where that happens for every API
// the daemon serves: GRPC here, and the request frontend maps the same
// kinds onto the OpenAI HTTP API's statuses.
//
// Code that refuses something builds its error with the constructor of
// its kind (Invalidf, Exhaustedf, Unavailablef, Preconditionf,
// Unauthenticatedf, Overloadedf, Forbiddenf, Internalf); wrapping keeps
// the kind. GRPC turns any error into the gRPC status a client gets.
//
// # Usage
//
//	if n > limit {
//		return apierr.Invalidf("prompt of %d tokens: at most %d", n, limit)
//	}
//	...
//	return resp, apierr.GRPC(err) // in an RPC handler
//
// # Concurrency
//
// Every function is safe for concurrent use; errors are immutable.
package apierr
