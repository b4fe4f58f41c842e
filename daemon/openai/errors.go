package openai

import (
	"context"
	"errors"
	"fmt"
	"net/http"
)

// apiError is an error as the client sees it: an HTTP status and OpenAI's
// error object.
type apiError struct {
	status  int
	typ     string
	param   string // the request field at fault, "" if none
	code    string
	message string
}

func (e *apiError) Error() string { return e.message }

// errorBody is OpenAI's error shape.
type errorBody struct {
	Error errorObject `json:"error"`
}

type errorObject struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

func (e *apiError) body() errorBody {
	b := errorBody{Error: errorObject{Message: e.message, Type: e.typ}}
	if e.param != "" {
		b.Error.Param = &e.param
	}
	if e.code != "" {
		b.Error.Code = &e.code
	}
	return b
}

// badRequest is a 400 naming the field at fault.
func badRequest(param, format string, args ...any) *apiError {
	return &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", param: param, message: fmt.Sprintf(format, args...)}
}

func modelNotFound(name string) *apiError {
	return &apiError{status: http.StatusNotFound, typ: "invalid_request_error", param: "model", code: "model_not_found",
		message: fmt.Sprintf("The model `%s` does not exist.", name)}
}

// toAPIError maps an error to what the client gets: domain kinds to their
// status (the one place this happens for HTTP), anything else 500.
func toAPIError(err error) *apiError {
	var ae *apiError
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.Is(err, ErrInvalid):
		return &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", message: err.Error()}
	case errors.Is(err, ErrOverloaded):
		return &apiError{status: http.StatusTooManyRequests, typ: "rate_limit_exceeded", code: "rate_limit_exceeded", message: err.Error()}
	case errors.Is(err, ErrUnavailable):
		return &apiError{status: http.StatusServiceUnavailable, typ: "service_unavailable", message: err.Error()}
	case errors.Is(err, context.DeadlineExceeded):
		return &apiError{status: http.StatusGatewayTimeout, typ: "timeout", message: err.Error()}
	}
	return &apiError{status: http.StatusInternalServerError, typ: "server_error", message: err.Error()}
}
